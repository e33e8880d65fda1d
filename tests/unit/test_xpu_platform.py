"""The XPU platform: import hygiene and probe everywhere; IPEX's kernels against the
float64 reference where IPEX is installed (tests/envs/xpu.sh builds that environment; on
a host without an Intel GPU the kernels are IPEX's CPU ones)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest
import torch

import platforms.xpu
from core.conformance.harness import SENTINEL, PagedCase, make_spec, mismatch, seeded
from core.plugins import Plugins
from platforms.xpu.platform import XpuPlatform

HAVE_IPEX = importlib.util.find_spec("intel_extension_for_pytorch") is not None


def test_importing_the_plugin_and_probing_import_no_ipex():
    code = (
        "import sys, platforms.xpu\n"
        "from platforms.xpu.platform import XpuPlatform\n"
        "XpuPlatform.probe()\n"
        "assert 'intel_extension_for_pytorch' not in sys.modules, 'IPEX was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)


def test_plugin_registers_the_platform():
    plugins = Plugins()
    plugins.register(platforms.xpu, "xpu")
    assert plugins.platforms()["xpu"] == ("xpu", XpuPlatform)


def test_probe_says_what_is_missing_or_how_it_runs():
    probe = XpuPlatform.probe()
    if not HAVE_IPEX:
        assert probe.score == 0 and "pip install 'core[xpu]'" in probe.reason
    elif not torch.xpu.is_available():
        # IPEX's CPU kernels: selectable, never preferred over the cpu platform
        assert probe.score == 1 and probe.emulated and "--platform xpu" in probe.reason
    else:
        assert probe.score == 100 and "XPU device" in probe.reason


# ---- with IPEX ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def platform() -> XpuPlatform:
    pytest.importorskip("intel_extension_for_pytorch", reason="needs IPEX (tests/envs/xpu.sh)")
    return XpuPlatform()


def test_platform_facts_follow_the_device(platform):
    if platform.on_device:
        assert platform.device_type == "xpu" and platform.distributed_backend() == "xccl"
        return
    assert platform.device_type == "cpu" and platform.device(0) == torch.device("cpu")
    assert platform.distributed_backend() == "gloo" and platform.capabilities == frozenset()
    assert platform.default_dtype(torch.bfloat16) == torch.float32
    assert platform.device_visibility_env == "ZE_AFFINITY_MASK"


def _scenario(case: PagedCase, name: str):
    """Steps of one scenario; every step's result is compared by the caller."""
    bs = case.spec.block_size
    if name == "prefill":
        seqs = [case.new_seq(n) for n in (bs + 3, 1, 2 * bs)]
        return [case.step([(s, len(s.keys)) for s in seqs], label=name)]
    if name == "chunked":
        a, b = case.new_seq(3 * bs), case.new_seq(bs + 6)
        return [
            case.step([(a, na), (b, nb)], label=f"{name} {na}/{nb}")
            for na, nb in ((bs - 3, 5), (bs + 7, bs), (2, 1))
        ]
    if name == "decode":
        seqs = [case.new_seq(n + 4) for n in (bs, 2 * bs + 3, 1)]
        for s, n in zip(seqs, (bs, 2 * bs + 3, 1)):
            case.write(s, n)
        return [case.step([], seqs, label=f"{name} {i}") for i in range(4)]
    a, b, c = case.new_seq(2 * bs), case.new_seq(bs + 2), case.new_seq(bs + 9)
    first = case.step([(b, bs + 1), (c, 7)], label="mixed setup")
    return [first, case.step([(a, 2 * bs), (c, bs + 2)], [b], label="mixed")]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [None, 11])
@pytest.mark.parametrize("name", ["prefill", "chunked", "decode", "mixed"])
def test_forward_matches_reference(platform, dtype, block_size, window, name):
    spec = make_spec(dtype, block_size, "gqa", window)
    case = PagedCase(platform, spec, 24, seeded("xpu", name, dtype, block_size, window))
    problems = [m for r in _scenario(case, name) if (m := mismatch(r, dtype))]
    assert not problems, "\n".join(problems)


def test_write_kv_skips_padding_slots(platform):
    spec = make_spec(torch.float32, 16)
    case = PagedCase(platform, spec, 8, seeded("xpu padding"))
    gen = seeded("xpu padding rows")
    key = torch.randn(6, spec.num_kv_heads, spec.head_size, generator=gen)
    value = torch.randn(6, spec.num_kv_heads, spec.head_size, generator=gen)
    slots = torch.tensor([-1, 35, -7, 16, 127, -1])  # 127: last slot of block 7
    case.backend.write_kv(key, value, case.cache, slots)
    k_cache, v_cache = case.cache[0], case.cache[1]  # [blocks, kv_heads, block, head]
    for row, slot in ((1, 35), (3, 16), (4, 127)):
        assert torch.equal(k_cache[slot // 16, :, slot % 16], key[row])
        assert torch.equal(v_cache[slot // 16, :, slot % 16], value[row])
    assert case.sentinel_count() == case.cache.numel() - 2 * 3 * spec.num_kv_heads * spec.head_size
    case.backend.write_kv(key[:2], value[:2], case.cache, torch.tensor([-1, -2]))  # no-op
    assert case.sentinel_count() == case.cache.numel() - 2 * 3 * spec.num_kv_heads * spec.head_size


def test_copy_and_swap_blocks_move_whole_blocks(platform):
    spec = make_spec(torch.float32, 16)
    case = PagedCase(platform, spec, 10, seeded("xpu blocks"))
    layers = [case.new_cache().normal_(generator=seeded("layer", i)) for i in range(2)]
    before = [c.clone() for c in layers]
    pairs = torch.tensor([[2, 7], [5, 1], [2, 9]])
    case.backend.copy_blocks(layers, pairs)
    for old, new in zip(before, layers):
        want = old.clone()
        for src, dst in pairs.tolist():
            want[:, dst] = old[:, src]
        assert torch.equal(new, want)
    host = case.backend.allocate_kv_cache(4, "cpu").fill_(SENTINEL)
    case.backend.swap_blocks(layers[0], host, torch.tensor([[7, 0], [3, 2]]))
    assert torch.equal(host[:, 0], layers[0][:, 7]) and torch.equal(host[:, 2], layers[0][:, 3])
    assert bool((host[:, 1] == SENTINEL).all()) and bool((host[:, 3] == SENTINEL).all())
