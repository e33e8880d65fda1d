"""Conformance checks: what a platform says about itself."""

from __future__ import annotations

import copy
import dataclasses
import os

import torch

from core.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig
from core.conformance.harness import Failures
from core.platform import VERIFICATION_LEVELS, Capability, Platform, ProbeResult

KNOWN_CAPABILITIES = {
    v for k, v in vars(Capability).items() if not k.startswith("_") and isinstance(v, str)
}


def test_probe(core_platform: Platform) -> None:
    """probe() returns a ProbeResult (int score >= 0, a reason) and has no side effects:
    same answer twice, environment, torch RNG state and default dtype unchanged."""
    f = Failures()
    f.case()
    env, rng, dtype = dict(os.environ), torch.random.get_rng_state(), torch.get_default_dtype()
    first, second = type(core_platform).probe(), type(core_platform).probe()
    f.expect(isinstance(first, ProbeResult), f"probe() returned {type(first).__name__}, not ProbeResult")
    if isinstance(first, ProbeResult):
        f.expect(
            isinstance(first.score, int) and first.score >= 0,
            f"probe().score is {first.score!r}; it must be an int >= 0 (0 = unusable here)",
        )
        f.expect(isinstance(first.reason, str) and first.reason.strip() != "", "probe().reason is empty")
    f.expect(first == second, f"probe() answered {first} then {second}")
    f.expect(dict(os.environ) == env, "probe() changed os.environ")
    f.expect(torch.equal(torch.random.get_rng_state(), rng), "probe() consumed or reseeded torch's RNG")
    f.expect(torch.get_default_dtype() == dtype, "probe() changed torch's default dtype")
    f.raise_if_any("probe")


def test_device_facts(core_platform: Platform) -> None:
    """device_count >= 1; memory_info is (free, total) ints with 0 < free <= total; the
    device type matches device(); verification is one of the documented levels;
    capabilities are known flags; distributed_backend is a non-empty name."""
    p, f = core_platform, Failures()
    f.case()
    count = p.device_count()
    f.expect(isinstance(count, int) and count >= 1, f"device_count() is {count!r}, expected >= 1")
    info = p.memory_info()
    ok = isinstance(info, tuple) and len(info) == 2 and all(isinstance(x, int) for x in info)
    f.expect(ok, f"memory_info() returned {info!r}, expected a (free, total) tuple of ints")
    if ok:
        free, total = info
        f.expect(0 < free <= total, f"memory_info() gave free={free}, total={total}; need 0 < free <= total")
    f.expect(p.device(0).type == p.device_type, f"device(0) is {p.device(0)}, device_type {p.device_type!r}")
    f.expect(
        p.verification in VERIFICATION_LEVELS,
        f"verification {p.verification!r} must be one of {VERIFICATION_LEVELS} (the evidence "
        f"belongs in the platform's docs, not in this attribute)",
    )
    unknown = set(p.capabilities) - KNOWN_CAPABILITIES
    f.expect(not unknown, f"unknown capability flags {sorted(unknown)}; known: {sorted(KNOWN_CAPABILITIES)}")
    backend = p.distributed_backend()
    f.expect(isinstance(backend, str) and backend != "", f"distributed_backend() is {backend!r}")
    f.raise_if_any("device facts")


def test_dtypes_and_block_sizes(core_platform: Platform) -> None:
    """supported_dtypes is a non-empty tuple of floating torch dtypes and default_dtype
    picks one of them; supported_block_sizes is non-empty positive ints containing the
    preferred one."""
    p, f = core_platform, Failures()
    f.case()
    dtypes = p.supported_dtypes()
    f.expect(
        len(dtypes) > 0 and all(isinstance(d, torch.dtype) and d.is_floating_point for d in dtypes),
        f"supported_dtypes() is {dtypes!r}; expected floating torch dtypes, at least one",
    )
    for ckpt in (torch.float32, torch.bfloat16, torch.float16):
        picked = p.default_dtype(ckpt)
        f.expect(picked in dtypes, f"default_dtype({ckpt}) is {picked}, not in {dtypes}")
    sizes = p.supported_block_sizes()
    f.expect(
        len(sizes) > 0 and all(isinstance(b, int) and b > 0 for b in sizes),
        f"supported_block_sizes() is {sizes!r}; expected positive ints, at least one",
    )
    f.expect(
        p.preferred_block_size() in sizes,
        f"preferred_block_size() {p.preferred_block_size()} is not in {sizes}",
    )
    f.raise_if_any("dtypes and block sizes")


def _config(platform: Platform, block_size: int, dtype: torch.dtype) -> EngineConfig:
    model = ModelConfig(
        model="conformance", tokenizer="conformance", architecture="LlamaForCausalLM",
        hf_config=None, dtype=str(dtype).removeprefix("torch."), max_model_len=256,
    )
    return EngineConfig(
        model=model,
        cache=CacheConfig(block_size=block_size),
        scheduler=SchedulerConfig(max_model_len=256),
        parallel=ParallelConfig(),
        platform=platform.name,
    )


def test_validate(core_platform: Platform) -> None:
    """validate() returns an EngineConfig without mutating its input; an unsupported block
    size is refused with ValueError (or replaced by a supported one)."""
    p, f = core_platform, Failures()
    f.case()
    config = _config(p, p.preferred_block_size(), p.supported_dtypes()[0])
    original = copy.deepcopy(dataclasses.asdict(config))
    result = p.validate(config)
    f.expect(isinstance(result, EngineConfig), f"validate() returned {type(result).__name__}")
    f.expect(dataclasses.asdict(config) == original, "validate() mutated its input config")
    if isinstance(result, EngineConfig):
        f.expect(
            result.cache.block_size in p.supported_block_sizes(),
            f"validate() chose block size {result.cache.block_size}, not in {p.supported_block_sizes()}",
        )
    bad = 1 + max(p.supported_block_sizes()) * 3
    try:
        fixed = p.validate(_config(p, bad, p.supported_dtypes()[0]))
        f.expect(
            fixed.cache.block_size in p.supported_block_sizes(),
            f"validate() accepted unsupported block size {bad} unchanged",
        )
    except ValueError as e:
        f.expect(str(bad) in str(e), f"validate()'s refusal of block size {bad} does not name it: {e}")
    f.raise_if_any("validate")
