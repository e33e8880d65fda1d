"""Capability flags mean something (issue #19): core reads every flag in
:class:`core.platform.Capability`, an emulation composes the same way on every platform
(:meth:`Platform.emulate_on_host`), ``core platforms`` sees the flags in force, and the host
memory reader and the default KV budget exist once, in core.platform."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

import core.platform as contract
from core.platform import (
    DEFAULT_HOST_KV_CACHE_BYTES,
    VERIFICATION_LEVELS,
    Capability,
    Platform,
    ProbeResult,
    capabilities_in_force,
    host_memory,
)
from core.plugins import PlatformInfo, load_plugins

CORE = Path(__file__).resolve().parents[2] / "core"
GiB = 1 << 30
FLAGS = {k: v for k, v in vars(Capability).items() if not k.startswith("_") and isinstance(v, str)}


class Device(Platform):
    """A minimal accelerator with its own memory (1 GiB free of 4 GiB)."""

    name = "dev"
    device_type = "dev"
    dispatch_key = "PrivateUse1"
    capabilities = frozenset(FLAGS.values())

    @classmethod
    def probe(cls):
        return ProbeResult(5, "test device")

    def device_count(self):
        return 1

    def memory_info(self, device_index=0):
        return (1 * GiB, 4 * GiB)

    def supported_dtypes(self):
        return (torch.float32,)

    def supported_block_sizes(self):
        return (16,)

    def attention_backend_class(self, spec, requested=None):
        raise AssertionError("not used here")


def _flag_reads() -> set[str]:
    """Capability flags core reads as ``Capability.NAME`` (docstrings and the class body,
    which only assigns them, do not count)."""
    read = set()
    for path in CORE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id == "Capability" and isinstance(node.ctx, ast.Load)):
                read.add(node.attr)
    return read


def test_core_reads_every_capability_flag():
    unread = set(FLAGS) - _flag_reads()
    assert not unread, f"flags nothing in core/ reads (read them or delete them): {sorted(unread)}"


def test_first_party_platforms_declare_only_known_flags_and_a_short_verification_level():
    plugins = load_plugins(only=("cpu", "cuda", "rocm", "xpu", "tpu", "hpu"))
    for name, (_, cls) in plugins.platforms().items():
        assert set(cls.capabilities) <= set(FLAGS.values()), (name, cls.capabilities)
        assert cls.verification in VERIFICATION_LEVELS, (name, cls.verification)


def test_an_emulating_instance_has_no_capabilities_and_host_tensors():
    p = Device()
    assert p.pin_host_memory() and not p.shares_host_memory() and p.ray_resource() == "GPU"
    p.emulate_on_host()
    assert p.emulated and p.capabilities == frozenset()
    assert (p.device_type, p.dispatch_key, p.device(0)) == ("cpu", "CPU", torch.device("cpu"))
    assert not p.pin_host_memory() and p.shares_host_memory() and p.ray_resource() == "CPU"
    assert Device.capabilities == frozenset(FLAGS.values())  # the class is untouched
    q = Device()
    q.emulate_on_host(host_tensors=False)  # XLA-style: the runtime emulates its device type
    assert q.emulated and q.capabilities == frozenset() and q.device_type == "dev"


def test_listing_shows_the_flags_in_force():
    emulated, real = ProbeResult(1, "x", emulated=True), ProbeResult(5, "x")
    assert capabilities_in_force(Device.capabilities, emulated) == frozenset()
    assert PlatformInfo("dev", "p", Device, real).capabilities == Device.capabilities
    assert PlatformInfo("dev", "p", Device, emulated).capabilities == frozenset()


def test_the_emulated_hpu_composes_the_same_way(monkeypatch):
    from platforms.hpu import EMULATE_ENV
    from platforms.hpu.platform import HpuPlatform, habana_installed

    if habana_installed():
        pytest.skip("habana_frameworks is installed: the HPU is not emulated here")
    monkeypatch.setenv(EMULATE_ENV, "1")
    assert HpuPlatform.probe().emulated
    p = HpuPlatform()
    assert p.emulated and p.capabilities == frozenset() and p.device_type == "cpu"
    assert p.ray_resource() == "CPU" and not p.pin_host_memory()


@pytest.mark.parametrize("available, expected", [(16 * GiB, DEFAULT_HOST_KV_CACHE_BYTES), (4 * GiB, 1 * GiB)])
def test_default_budget_in_host_ram_is_capped_at_a_quarter_of_available(monkeypatch, available, expected):
    monkeypatch.setattr(contract, "host_memory", lambda: (available, 32 * GiB))
    assert DEFAULT_HOST_KV_CACHE_BYTES == 2 * GiB
    p = Device()
    p.emulate_on_host()
    assert p.kv_cache_budget(None, 0.9, weights_bytes=GiB) == expected
    assert p.kv_cache_budget(123, 0.9, weights_bytes=GiB) == 123


def test_default_budget_with_device_memory_uses_the_utilization():
    # 4 GiB total, 3 GiB used by others: 0.9 * 4 GiB - 3 GiB - 0.25 GiB of weights
    got = Device().kv_cache_budget(None, 0.9, weights_bytes=GiB // 4)
    assert got == int(4 * GiB * 0.9) - 3 * GiB - GiB // 4


def test_host_memory_reads_meminfo():
    fields = {}
    for line in Path("/proc/meminfo").read_text().splitlines():
        key, value = line.split(":", 1)
        fields[key] = int(value.split()[0]) * 1024
    available, total = host_memory()
    assert total == fields["MemTotal"] and 0 < available <= total


def test_every_platform_uses_the_one_host_memory_reader():
    """No platform module restates /proc/meminfo or sysconf page counting."""
    root = CORE.parent
    for path in [*root.glob("platforms/*/platform.py"), *root.glob("plugins/*/src/*/platform.py")]:
        text = path.read_text()
        assert "/proc/meminfo" not in text and "SC_AVPHYS_PAGES" not in text, path
