"""The device penalty state (core/sampler/penalties.py) on the GPU, through the fused kernel.

With ``Sampler(penalty_state=True)`` (the model runner's choice on CUDA) a penalised row's
repetition flags and output counts come from a device table the kernel reads next to the
logits, instead of the host-built edit list. The float operations are the same, so tokens
and logprobs must equal the edit-list path's exactly; a continuing row must not make the
host wait for the device; and a decode loop whose later steps carry no history at all
(what the state path needs) must give the edit-list path's tokens.

Run on the GPU machine: ``PYTHONPATH=. python3 -m pytest -q tests/cuda/test_cuda_sampler_penalty_state.py``.
Written without a GPU (2026-12-02): the same assertions pass on the host with the kernel's
source built for the CPU (tests/unit/test_sampler_penalty_state.py).
"""

from __future__ import annotations

import warnings

import msgspec
import pytest
import torch

from core.sampler import Sampler, Staging
from core.sampling_params import SamplingParams

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs an NVIDIA GPU"),
]

PINNED = Staging(pinned=True)


def kernel():
    from platforms.cuda.sampling import CudaSamplingKernel

    return CudaSamplingKernel()


def _ids(rows):
    return [msgspec.structs.replace(r, seq_id=i) for i, r in enumerate(rows)]


def test_state_path_equals_the_edit_list_path_on_mixed_batches() -> None:
    from tests.unit.test_sampler_exact import EOS, _batch

    for seed in range(320):
        logits, rows = _batch(seed)
        rows = _ids(rows)
        x = logits.cuda()
        a = Sampler(frozenset({EOS}), seed=seed, staging=PINNED, kernel=kernel())
        b = Sampler(frozenset({EOS}), seed=seed, staging=PINNED, kernel=kernel(), penalty_state=True)
        assert b(x, rows) == a(x, rows), seed


@pytest.mark.parametrize("temperature,top_k", [(1.0, 0), (1.0, 50), (0.0, 0)])
def test_decode_steps_at_batch_256_and_llama3_vocab(temperature: float, top_k: int) -> None:
    """256 x 128,256, 512 prompt + 128 output ids per row; then 4 decode steps in which the
    state path gets no history at all while the edit-list path gets the whole of it."""
    from core.benchmarks.sampler import make_logits, make_rows

    params = SamplingParams(temperature=temperature, top_k=top_k, repetition_penalty=1.1,
                            presence_penalty=0.5, frequency_penalty=0.3)
    rows = make_rows(256, 128256, lambda i: params)
    a = Sampler(frozenset({0}), seed=3, staging=PINNED, kernel=kernel())
    b = Sampler(frozenset({0}), seed=3, staging=PINNED, kernel=kernel(), penalty_state=True)
    for step in range(5):
        x = make_logits(256, 128256, "peaked", seed=step).cuda()
        want = a(x, rows)
        bare = rows if step == 0 else [msgspec.structs.replace(r, prompt_token_ids=(), output_token_ids=())
                                       for r in rows]
        assert b(x, bare) == want, step
        rows = [msgspec.structs.replace(r, output_token_ids=(*r.output_token_ids, t),
                                        output_index=r.output_index + 1)
                for r, t in zip(rows, want.token_ids)]


def test_a_continuing_row_does_not_wait_for_the_device() -> None:
    from core.benchmarks.sampler import make_logits, make_rows

    params = SamplingParams(temperature=0.8, repetition_penalty=1.2, frequency_penalty=0.4)
    rows = make_rows(64, 32000, lambda i: params)
    x = make_logits(64, 32000, "peaked").cuda()
    s = Sampler(frozenset({0}), seed=0, staging=PINNED, kernel=kernel(), penalty_state=True)
    s.sample_tensors(x, rows)  # joins the state (and warms the pools)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        s.sample_tensors(x, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            s(x, rows)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert len([w for w in caught if "synchroniz" in str(w.message)]) == 1  # the read-back
