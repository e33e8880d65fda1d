"""PoolingState: last / mean pooling over prefill chunks equals plain torch over the whole
prompt (fresh random hidden states), a recompute from position 0 starts afresh, and the
engine core's attach_pooled puts each vector on its request's delta."""

from __future__ import annotations

import pytest
import torch

from core import pooling
from core.engine_core.types import RequestDelta
from core.pooling import LOST, PoolingParams, PoolingState, attach_pooled
from core.sampling_params import SamplingParams


def _chunks(hidden: torch.Tensor, sizes: list[int]):
    start = 0
    for k in sizes:
        yield start, hidden[start:start + k], start + k == hidden.shape[0]
        start += k


@pytest.mark.parametrize("kind", ["last", "mean"])
@pytest.mark.parametrize("normalize", [True, False])
def test_chunked_pooling_equals_whole_prompt(kind, normalize):
    torch.manual_seed(1)
    hidden = torch.randn(23, 8)
    want = hidden[-1] if kind == "last" else hidden.mean(0)
    want = torch.nn.functional.normalize(want, dim=0) if normalize else want
    state, params = PoolingState(), PoolingParams(kind, normalize)
    results = [state.add_chunk(7, start, rows, params, final) for start, rows, final in _chunks(hidden, [5, 9, 9])]
    assert results[:2] == [None, None]
    torch.testing.assert_close(results[2], want)
    assert not state._sums


def test_a_recompute_from_position_zero_starts_afresh():
    torch.manual_seed(2)
    stale, hidden = torch.randn(4, 8), torch.randn(10, 8)
    state, params = PoolingState(), PoolingParams("mean", False)
    state.add_chunk(3, 0, stale, params, False)  # then preempted by recompute
    state.add_chunk(3, 0, hidden[:6], params, False)
    torch.testing.assert_close(state.add_chunk(3, 6, hidden[6:], params, True), hidden.mean(0))
    assert not state._sums


def test_a_swapped_sequence_keeps_its_sum_and_a_lost_one_says_so(monkeypatch):
    torch.manual_seed(3)
    hidden = torch.randn(12, 8)
    state, params = PoolingState(), PoolingParams("mean", True)
    state.add_chunk(5, 0, hidden[:4], params, False)
    for _ in range(50):  # swapped out for a while: steps without it
        state.begin_step()
    torch.testing.assert_close(state.add_chunk(5, 4, hidden[4:], params, True),
                               torch.nn.functional.normalize(hidden.mean(0), dim=0))
    # a sum over other positions than the chunk continues from is never extended
    state.add_chunk(6, 0, hidden[:4], params, False)
    assert state.add_chunk(6, 5, hidden[5:], params, True) == LOST
    # an abort mid-prompt leaves a sum that is dropped once stale; a late chunk gets LOST
    monkeypatch.setattr(pooling, "STALE_STEPS", 10)
    state.add_chunk(7, 0, hidden[:4], params, False)
    for _ in range(2048):
        state.begin_step()
    assert not state._sums
    assert state.add_chunk(7, 4, hidden[4:], params, True) == LOST


def test_bad_pooling_type_is_refused():
    with pytest.raises(ValueError, match=r"PoolingParams.type='max' is invalid: must be one of \['last', 'mean'\]"):
        PoolingParams("max")


def test_attach_pooled_sets_the_vector_on_its_request_delta():
    class Sched:
        scheduled = (type("S", (), {"request_id": "a", "seq_id": 11})(), type("S", (), {"request_id": "b", "seq_id": 12})())

    deltas = [RequestDelta("a"), RequestDelta("b")]
    out = attach_pooled(deltas, Sched(), {12: (0.5, -1.0)})
    assert out[0].pooled is None and out[1].pooled == (0.5, -1.0)
    assert SamplingParams(pooling=PoolingParams()).pooling.type == "last"
