"""The MoE building blocks against plain references on fresh random inputs.

* ``ops.fused_moe`` (grouped by expert) vs a per-token, per-choice loop;
* ``select_experts`` vs transformers' own router (Qwen2-MoE's, with and without
  renormalisation; Mixtral's always renormalises);
* ``FusedExperts`` sharded along the FFN dim over 2 and 4 ranks == one rank;
* attention logit soft-capping (Gemma 2) on the CPU backend vs ``reference_attention``, and
  a backend without it refusing such a layer.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from core.attention import AttentionBackend, AttentionSpec, reference_attention
from core.models.moe import FusedExperts, select_experts
from core.ops import fused_moe
from tests.helpers import PagedSession, cpu_context, run_ranks


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def naive_moe(x, w13, w2, weights, ids):
    out = torch.zeros_like(x, dtype=torch.float64)
    ffn = w2.shape[2]
    for t in range(x.shape[0]):
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            h = w13[e].double() @ x[t].double()
            y = w2[e].double() @ (F.silu(h[:ffn]) * h[ffn:])
            out[t] += weights[t, j].double() * y
    return out


@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 1), (13, 8, 2), (40, 6, 3), (7, 16, 2)])
def test_fused_moe_matches_a_per_token_loop(tokens, experts, k):
    hidden, ffn = 24, 20
    x = rand(tokens, hidden, seed=1)
    w13, w2 = rand(experts, 2 * ffn, hidden, seed=2) * 0.3, rand(experts, hidden, ffn, seed=3) * 0.3
    weights, ids = select_experts(rand(tokens, experts, seed=4), k, renormalize=True)
    got = fused_moe(x, w13, w2, weights, ids)
    assert got.dtype == x.dtype and got.shape == x.shape
    torch.testing.assert_close(got.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_fused_moe_in_bfloat16_accumulates_in_fp32():
    x = rand(9, 32, seed=5)
    w13, w2 = rand(4, 64, 32, seed=6) * 0.2, rand(4, 32, 32, seed=7) * 0.2
    weights, ids = select_experts(rand(9, 4, seed=8), 2, renormalize=False)
    got = fused_moe(x.bfloat16(), w13.bfloat16(), w2.bfloat16(), weights, ids)
    ref = naive_moe(x, w13, w2, weights, ids)
    assert got.dtype == torch.bfloat16
    torch.testing.assert_close(got.double(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("norm", [False, True])
def test_select_experts_matches_transformers_router(norm):
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeTopKRouter

    cfg = Qwen2MoeConfig(hidden_size=16, num_experts=8, num_experts_per_tok=3, norm_topk_prob=norm)
    router = Qwen2MoeTopKRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(rand(8, 16, seed=9))
    x = rand(11, 16, seed=10)
    logits, hf_weights, hf_ids = router(x)
    weights, ids = select_experts(logits, 3, norm)
    assert torch.equal(ids, hf_ids)
    torch.testing.assert_close(weights, hf_weights.float())


def test_mixtral_renormalised_top_k_equals_softmax_over_the_chosen_logits():
    logits = rand(20, 8, seed=11)
    weights, ids = select_experts(logits, 2, renormalize=True)
    torch.testing.assert_close(weights, torch.softmax(logits.gather(1, ids), dim=-1))


@pytest.mark.parametrize("tp", [2, 4])
def test_experts_sharded_along_ffn_equal_unsharded(tp):
    experts, hidden, ffn = 4, 16, 24
    per_expert = [(rand(ffn, hidden, seed=20 + e), rand(ffn, hidden, seed=30 + e),
                   rand(hidden, ffn, seed=40 + e)) for e in range(experts)]
    x = rand(10, hidden, seed=12)
    weights, ids = select_experts(rand(10, experts, seed=13), 2, renormalize=True)

    def build(comm=None):
        layer = FusedExperts(experts, hidden, ffn, cpu_context(comm=comm))
        for e, tensors in enumerate(per_expert):
            for part, t in enumerate(tensors):
                layer.load_weight("w", t, (e, part))
        return layer(x, weights, ids)

    single = build()
    for out in run_ranks(tp, build):
        torch.testing.assert_close(out, single, rtol=1e-5, atol=1e-5)
    w13 = torch.stack([torch.cat(t[:2]) for t in per_expert])
    w2 = torch.stack([t[2] for t in per_expert])
    torch.testing.assert_close(single.double(), naive_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_an_expert_id_beyond_the_config_is_refused():
    layer = FusedExperts(2, 8, 8, cpu_context())
    with pytest.raises(ValueError, match="checkpoint has expert 2 but the config has 2 experts"):
        layer.load_weight("w", torch.zeros(8, 8), (2, 0))


# ---- attention logit soft-capping ----------------------------------------------------------------


class _OneLayer(torch.nn.Module):
    """Feeds given q/k/v through one attention backend (a 'model' for PagedSession)."""

    def __init__(self, spec, q, k, v):
        super().__init__()
        from platforms.cpu.attention import CpuAttentionBackend

        self.spec, self.attn = spec, CpuAttentionBackend(spec)
        self.q, self.k, self.v = q, k, v

    def attention_specs(self):
        return [self.spec]

    def forward(self, ids, positions, kv_caches, md):
        rows = ids  # token ids are row indices into the prepared q/k/v
        return self.attn.forward(self.q[rows], self.k[rows], self.v[rows], kv_caches[0], md).flatten(1)

    def compute_logits(self, hidden):
        return hidden


@pytest.mark.parametrize("window", [None, 5])
def test_cpu_attention_soft_caps_logits_like_the_reference(window):
    spec = AttentionSpec(4, 2, 8, torch.float32, 4, sliding_window=window, logits_soft_cap=1.5)
    n = 30
    q, k, v = rand(n, 4, 8, seed=14) * 2, rand(n, 2, 8, seed=15) * 2, rand(n, 2, 8, seed=16)
    session = PagedSession(_OneLayer(spec, q, k, v), block_size=4)
    # rows 0-10: a prompt in two chunks (the second over cached context), then 3 decodes
    outs = session.step([("a", list(range(0, 6)))])
    outs += session.step([("a", list(range(6, 11)))])
    for t in range(11, 14):
        outs += session.step([], [("a", t)])
    got = torch.cat(outs).view(-1, 4, 8)
    ref = reference_attention(q[:14], [k[:14]], [v[:14]], [14], spec.softmax_scale, window, 1.5)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    uncapped = reference_attention(q[:14], [k[:14]], [v[:14]], [14], spec.softmax_scale, window)
    assert not torch.allclose(uncapped, ref, atol=1e-3)  # the cap changes these outputs


def test_a_backend_without_soft_capping_refuses_such_a_layer():
    class NoCap(AttentionBackend):
        name = "nocap"
        kv_cache_shape = write_kv = forward = copy_blocks = swap_blocks = None

    with pytest.raises(ValueError, match="'nocap' does not implement attention logit soft-capping"):
        NoCap(AttentionSpec(2, 2, 8, torch.float32, 16, logits_soft_cap=50.0))


@pytest.mark.skipif(not hasattr(torch, "_grouped_mm"), reason="this torch has no _grouped_mm")
@pytest.mark.parametrize("tokens,experts,k", [(1, 4, 1), (29, 8, 2), (5, 16, 4)])
def test_grouped_gemm_moe_equals_the_reference(tokens, experts, k):
    """The CUDA platform's sync-free formulation, run wherever torch._grouped_mm exists (CPU
    here); experts without tokens (most of them when tokens * k < experts) are empty groups."""
    from platforms.cuda.moe import grouped_fused_moe

    x = rand(tokens, 32, seed=17)
    w13, w2 = rand(experts, 48, 32, seed=18) * 0.3, rand(experts, 32, 24, seed=19) * 0.3
    weights, ids = select_experts(rand(tokens, experts, seed=20), k, renormalize=False)
    got = grouped_fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)


def test_dense_fallback_equals_the_reference():
    """The CUDA platform's capture-safe fallback (every expert over every token)."""
    from platforms.cuda.moe import dense_fused_moe

    x = rand(11, 16, seed=21)
    w13, w2 = rand(6, 40, 16, seed=22) * 0.3, rand(6, 16, 20, seed=23) * 0.3
    weights, ids = select_experts(rand(11, 6, seed=24), 2, renormalize=True)
    got = dense_fused_moe(x, w13, w2, weights, ids)
    torch.testing.assert_close(got, fused_moe(x, w13, w2, weights, ids), rtol=1e-5, atol=1e-5)
