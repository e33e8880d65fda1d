"""Parallel layers: plain behaviour at one rank, and sharded == unsharded across ranks.

Ranks are threads joined by a real in-process all-reduce/all-gather (tests.helpers.run_ranks),
so each rank only sees its shard, exactly as under torch.distributed.
"""

from __future__ import annotations

import types

import pytest
import torch
import torch.nn.functional as F

from core.models.layers import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RotaryEmbedding,
    RowParallelLinear,
    VocabParallelEmbedding,
    load_checkpoint,
    rope_parameters,
)
from tests.helpers import LLAMA3_ROPE, cpu_context, run_ranks


def rand(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def ctx_for(comm=None):
    return cpu_context(comm=comm)


# ---- one rank: the layers are plain layers -------------------------------------------------------


def test_column_and_row_linear_single_rank_match_f_linear():
    w, b, x = rand(24, 16, seed=1), rand(24, seed=2), rand(5, 16, seed=3)
    col = ColumnParallelLinear(16, 24, ctx_for(), bias=True)
    col.load_weight("weight", w)
    col.load_weight("bias", b)
    torch.testing.assert_close(col(x), F.linear(x, w, b), rtol=0, atol=0)
    row = RowParallelLinear(16, 24, ctx_for(), bias=True)
    row.load_weight("weight", w)
    row.load_weight("bias", b)
    torch.testing.assert_close(row(x), F.linear(x, w, b), rtol=0, atol=0)


def test_merged_and_qkv_single_rank_concatenate_their_parts():
    gate, up, x = rand(12, 8, seed=1), rand(12, 8, seed=2), rand(3, 8, seed=3)
    merged = MergedColumnParallelLinear(8, [12, 12], ctx_for())
    merged.load_weight("weight", gate, 0)
    merged.load_weight("weight", up, 1)
    torch.testing.assert_close(merged(x), torch.cat([x @ gate.T, x @ up.T], -1))

    q, k, v = rand(4 * 6, 8, seed=4), rand(2 * 6, 8, seed=5), rand(2 * 6, 8, seed=6)
    qkv = QKVParallelLinear(8, 6, 4, 2, ctx_for())
    for shard, t in zip("qkv", (q, k, v)):
        qkv.load_weight("weight", t, shard)
    assert (qkv.q_size, qkv.kv_size) == (24, 12)
    torch.testing.assert_close(qkv(x), torch.cat([x @ q.T, x @ k.T, x @ v.T], -1))


def test_merged_gate_up_silu_and_mul_goes_through_the_format_and_needs_two_equal_parts():
    """The MLP's gate/up layer hands SiLU-and-mul to its format (which may fuse it; the dense
    format applies the op it is given to its product); other merged shapes are refused."""
    from core.ops import silu_and_mul

    gate, up, x = rand(12, 8, seed=1), rand(12, 8, seed=2), rand(3, 8, seed=3)
    merged = MergedColumnParallelLinear(8, [12, 12], ctx_for())
    merged.load_weight("weight", gate, 0)
    merged.load_weight("weight", up, 1)
    seen = []
    got = merged.silu_and_mul(x, lambda y: seen.append(y.shape) or silu_and_mul(y))
    assert seen == [(3, 24)]
    torch.testing.assert_close(got, F.silu(x @ gate.T) * (x @ up.T))
    with pytest.raises(ValueError, match=r"two equal outputs, not \[12, 4\]"):
        MergedColumnParallelLinear(8, [12, 4], ctx_for()).silu_and_mul(x, silu_and_mul)


def test_embedding_and_lm_head_single_rank():
    w, ids, h = rand(10, 6, seed=1), torch.tensor([0, 9, 3, 3]), rand(4, 6, seed=2)
    emb = VocabParallelEmbedding(10, 6, ctx_for())
    emb.load_weight("weight", w)
    torch.testing.assert_close(emb(ids), w[ids], rtol=0, atol=0)
    head = ParallelLMHead(10, 6, ctx_for())
    head.load_weight("weight", w)
    logits = head(h)
    assert logits.dtype == torch.float32 and logits.shape == (4, 10)
    torch.testing.assert_close(logits, h @ w.T)
    tied = ParallelLMHead(10, 6, ctx_for(), tied=emb)
    assert tied.weight is emb.weight


def test_rms_norm_matches_naive_and_fuses_residual():
    x, r, w = rand(5, 32, seed=1), rand(5, 32, seed=2), rand(32, seed=3)
    norm = RMSNorm(32, 1e-6, ctx_for())
    norm.load_weight("weight", w)

    def naive(t):
        return t / torch.sqrt((t.double() ** 2).mean(-1, keepdim=True) + 1e-6).float() * w

    torch.testing.assert_close(norm(x), naive(x))
    out, res = norm(x, r)
    torch.testing.assert_close(res, x + r)
    torch.testing.assert_close(out, naive(x + r))


# ---- rotary ------------------------------------------------------------------------------------


HALF = 8  # head_dim 16: 8 rotation frequencies
ROPES = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500.0, "factor": 4.0},
    "llama3": LLAMA3_ROPE,
    # positions below max_position_embeddings: HF's dynamic frequencies are the default ones
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
             "original_max_position_embeddings": 64},
    "yarn-mscale-untruncated": {
        "rope_type": "yarn", "rope_theta": 50000.0, "factor": 8.0, "mscale": 0.7,
        "mscale_all_dim": 1.3, "beta_fast": 16, "beta_slow": 2, "truncate": False,
        "original_max_position_embeddings": 32,
    },
    "yarn-attention-factor": {
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "attention_factor": 1.5,
        "original_max_position_embeddings": 128,
    },
    # short factors below position 64, long factors from there (two HF calls below)
    "longrope": {
        "rope_type": "longrope", "rope_theta": 10000.0,
        "original_max_position_embeddings": 64,
        "short_factor": [1.0 + 0.1 * i for i in range(HALF)],
        "long_factor": [2.0 + 0.5 * i for i in range(HALF)],
    },
    "longrope-attention-factor": {
        "rope_type": "longrope", "rope_theta": 10000.0, "attention_factor": 0.8,
        "original_max_position_embeddings": 100, "factor": 3.0,
        "short_factor": [1.5] * HALF, "long_factor": [1.0 + i for i in range(HALF)],
    },
}


@pytest.mark.parametrize("kind", sorted(ROPES))
def test_rotary_matches_transformers(kind):
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

    cfg = LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        rope_parameters=dict(ROPES[kind]),
    )
    rope = RotaryEmbedding(16, 16, 256, rope_parameters(cfg), ctx_for())
    orig = ROPES[kind].get("original_max_position_embeddings", 256)
    # HF picks LongRoPE's factors from the longest position of a call: one call per side
    every = [0, 1, 7, 63, 64, 100, 255]
    for side in ([p for p in every if p < orig], [p for p in every if p >= orig]):
        if not side:
            continue
        positions = torch.tensor(side)
        q = rand(len(positions), 4, 16, seed=1)
        k = rand(len(positions), 2, 16, seed=2)
        ours_q, ours_k = rope(positions, q, k)
        cos, sin = LlamaRotaryEmbedding(cfg)(q, positions[None])
        ref_q, ref_k = apply_rotary_pos_emb(q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin)
        torch.testing.assert_close(ours_q, ref_q[0].transpose(0, 1), rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(ours_k, ref_k[0].transpose(0, 1), rtol=1e-5, atol=1e-5)


def test_rope_parameters_reads_transformers4_style_config():
    old = types.SimpleNamespace(rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert rope_parameters(old) == {
        "type": "linear",
        "factor": 2.0,
        "rope_theta": 5e5,
        "rope_type": "linear",
    }
    assert rope_parameters(types.SimpleNamespace())["rope_type"] == "default"


def test_unknown_rope_type_is_refused_by_name():
    with pytest.raises(ValueError, match="rope type 'mrope' is not supported; supported: default"):
        RotaryEmbedding(16, 16, 32, {"rope_type": "mrope", "rope_theta": 1e4}, ctx_for())


# ---- several ranks: sharded == unsharded ---------------------------------------------------------


@pytest.mark.parametrize("tp", [2, 4])
def test_column_row_pair_sharded_equals_unsharded(tp):
    """The MLP pattern: column-parallel up (sharded output) then row-parallel down."""
    w1, b1, w2, b2, x = (
        rand(32, 16, seed=1),
        rand(32, seed=2),
        rand(16, 32, seed=3),
        rand(16, seed=4),
        rand(5, 16, seed=5),
    )
    expected = F.linear(F.linear(x, w1, b1), w2, b2)

    def rank(comm):
        up = ColumnParallelLinear(16, 32, ctx_for(comm), bias=True)
        down = RowParallelLinear(32, 16, ctx_for(comm), bias=True)
        for layer, w, b in ((up, w1, b1), (down, w2, b2)):
            layer.load_weight("weight", w)
            layer.load_weight("bias", b)
        assert up.weight.shape == (32 // tp, 16) and down.weight.shape == (16, 32 // tp)
        gathered = ColumnParallelLinear(16, 32, ctx_for(comm), bias=True, gather_output=True)
        gathered.load_weight("weight", w1)
        gathered.load_weight("bias", b1)
        return down(up(x)), gathered(x)

    for out, full in run_ranks(tp, rank):
        torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(full, F.linear(x, w1, b1))


@pytest.mark.parametrize("tp,kv_heads", [(2, 2), (4, 2), (4, 1), (2, 4)])
def test_qkv_shards_heads_and_replicates_kv_heads(tp, kv_heads):
    heads, d, hidden = 4, 3, 8
    q, k, v = (
        rand(heads * d, hidden, seed=1),
        rand(kv_heads * d, hidden, seed=2),
        rand(kv_heads * d, hidden, seed=3),
    )
    x = rand(2, hidden, seed=4)
    fq, fk, fv = (x @ t.T for t in (q, k, v))

    def rank(comm):
        layer = QKVParallelLinear(hidden, d, heads, kv_heads, ctx_for(comm))
        for shard, t in zip("qkv", (q, k, v)):
            layer.load_weight("weight", t, shard)
        return comm.rank, layer.num_heads, layer.num_kv_heads, layer(x)

    for r, nh, nkv, out in run_ranks(tp, rank):
        assert nh == heads // tp and nkv == max(1, kv_heads // tp)
        kv_head = r * nkv if kv_heads >= tp else r // (tp // kv_heads)
        oq, ok, ov = out.split([nh * d, nkv * d, nkv * d], -1)
        torch.testing.assert_close(oq, fq[:, r * nh * d : (r + 1) * nh * d])
        torch.testing.assert_close(ok, fk[:, kv_head * d : (kv_head + nkv) * d])
        torch.testing.assert_close(ov, fv[:, kv_head * d : (kv_head + nkv) * d])


@pytest.mark.parametrize("tp", [2, 3, 4])
def test_vocab_parallel_embedding_and_head_equal_unsharded(tp):
    vocab = 10  # not a multiple of 3 or 4: the last rank holds padding rows
    w, h = rand(vocab, 6, seed=1), rand(3, 6, seed=2)
    ids = torch.tensor([0, 9, 4, 5, 3, 6, 9])

    def rank(comm):
        emb = VocabParallelEmbedding(vocab, 6, ctx_for(comm))
        emb.load_weight("weight", w)
        head = ParallelLMHead(vocab, 6, ctx_for(comm), tied=emb)
        return emb(ids), head(h)

    for e, logits in run_ranks(tp, rank):
        torch.testing.assert_close(e, w[ids], rtol=0, atol=0)
        assert logits.shape == (3, vocab)
        torch.testing.assert_close(logits, h @ w.T)


def test_merged_column_sharded_keeps_each_part_on_every_rank():
    gate, up, x = rand(8, 4, seed=1), rand(8, 4, seed=2), rand(3, 4, seed=3)

    def rank(comm):
        layer = MergedColumnParallelLinear(4, [8, 8], ctx_for(comm))
        layer.load_weight("weight", gate, 0)
        layer.load_weight("weight", up, 1)
        return comm.rank, layer(x)

    for r, out in run_ranks(2, rank):
        g, u = out.split(4, -1)
        torch.testing.assert_close(g, (x @ gate.T)[:, r * 4 : (r + 1) * 4])
        torch.testing.assert_close(u, (x @ up.T)[:, r * 4 : (r + 1) * 4])


def test_indivisible_sizes_are_refused_with_the_numbers():
    def rank(comm):
        QKVParallelLinear(8, 2, 6, 2, ctx_for(comm))

    with pytest.raises(
        ValueError,
        match=r"number of attention heads \(6\) is not divisible by the tensor-parallel size \(4\)",
    ):
        run_ranks(4, rank)


# ---- checkpoint loading ------------------------------------------------------------------------


class _Tiny(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = QKVParallelLinear(4, 2, 2, 1, ctx_for())
        self.norm = RMSNorm(4, 1e-6, ctx_for())


STACKED = (("q_proj.", "proj.", "q"), ("k_proj.", "proj.", "k"), ("v_proj.", "proj.", "v"))


def _ckpt(*drop):
    full = {
        "q_proj.weight": rand(4, 4, seed=1),
        "k_proj.weight": rand(2, 4, seed=2),
        "v_proj.weight": rand(2, 4, seed=3),
        "norm.weight": rand(4, seed=4),
    }
    return [(n, t) for n, t in full.items() if n not in drop]


def test_load_checkpoint_fuses_stacked_names():
    m = _Tiny()
    ckpt = dict(_ckpt())
    load_checkpoint(m, ckpt.items(), STACKED)
    torch.testing.assert_close(
        m.proj.weight,
        torch.cat([ckpt["q_proj.weight"], ckpt["k_proj.weight"], ckpt["v_proj.weight"]]),
    )
    torch.testing.assert_close(m.norm.weight, ckpt["norm.weight"])


def test_load_checkpoint_reports_missing_shard_unknown_name_and_bad_shape():
    with pytest.raises(ValueError, match=r"no weights for 1 parameter.*proj\.weight\[k\]"):
        load_checkpoint(_Tiny(), _ckpt("k_proj.weight"), STACKED)
    with pytest.raises(ValueError, match="'extra.weight' matches no parameter"):
        load_checkpoint(_Tiny(), _ckpt() + [("extra.weight", rand(3))], STACKED)
    bad = [(n, rand(5) if n == "norm.weight" else t) for n, t in _ckpt()]
    with pytest.raises(ValueError, match=r"shape \(5,\) but the model expects \(4,\)"):
        load_checkpoint(_Tiny(), bad, STACKED)


def test_quantize_on_load_hands_silu_and_mul_to_its_inner_method():
    """`--quantization` run dequantized (QuantizeOnLoad) keeps the platform method's own
    apply_silu_and_mul (the CUDA dense method fuses it), not the base class's two ops."""
    from core.models.layers import LinearMethod
    from core.quantization.linear import QuantizeOnLoad

    class Inner(LinearMethod):
        name = "inner"

        def apply_silu_and_mul(self, layer, x, bias, silu_and_mul):
            return ("inner", x)

    x = rand(2, 8)
    method = QuantizeOnLoad(Inner(), quant=types.SimpleNamespace(name="q"))
    assert method.apply_silu_and_mul(None, x, None, None) == ("inner", x)


def test_a_format_that_rotates_in_the_qkv_projection_gives_the_same_model(tiny_llama):
    """LlamaAttention asks the QKV layer's format to rotate q and k itself
    (LinearMethod.apply_rope); a format that does (here: the product, then core's rotation,
    in one call, for decode steps only) leaves every logit of a mixed prefill/decode
    schedule unchanged (so the model skipped its own rotation there: twice rotated would
    differ). Families
    with per-head work before the rotation (Qwen3's q/k norms) never ask."""
    from core.models.layers import LinearMethod, QKVParallelLinear
    from core.models.llama import LlamaAttention
    from core.models.qwen3 import Qwen3Attention
    from tests.helpers import load_tiny, run_schedule

    calls = []

    class RotatingDense(LinearMethod):
        def apply_rope(self, layer, x, bias, positions, rotary):
            if x.shape[0] > 3:  # decode steps only (three rows)
                return None
            calls.append(x.shape[0])
            qkv = self.apply(layer, x, bias)
            q, k, v = qkv.split([layer.q_size, layer.kv_size, layer.kv_size], dim=-1)
            d = layer.head_size
            q, k = rotary(positions, q.view(-1, layer.num_heads, d), k.view(-1, layer.num_kv_heads, d))
            return torch.cat([q.reshape(x.shape[0], -1), k.reshape(x.shape[0], -1), v], dim=-1)

    path = tiny_llama()
    want = run_schedule(load_tiny(path), vocab=128, decode_steps=3, lengths=(5, 1, 9))
    model = load_tiny(path)
    for m in model.modules():
        if isinstance(m, QKVParallelLinear):
            m.linear_method = RotatingDense()
    got = run_schedule(model, vocab=128, decode_steps=3, lengths=(5, 1, 9))
    assert calls and set(calls) <= {2, 3}, calls  # the decode steps' rows, every layer
    for s in want:
        assert got[s][0] == want[s][0]
        torch.testing.assert_close(got[s][1], want[s][1], rtol=1e-5, atol=1e-5)
    asks = LlamaAttention._rope_in_projection.fget
    assert asks(object.__new__(LlamaAttention)) and not asks(object.__new__(Qwen3Attention))


class _FoldingDense:
    """A dense format that folds the input norm into its products and adds the residual itself
    for decode-sized steps (at most three rows), as the CUDA GEMV does on one or two rows; it
    records what it was handed."""

    def __new__(cls, calls):
        from core.models.layers import LinearMethod

        class FoldingDense(LinearMethod):
            name = "folding"

            def folds_norm(self, layer, x, norm):
                return x.shape[0] <= 3

            def adds_residual(self, layer, x, residual):
                return x.shape[0] <= 3

            def apply(self, layer, x, bias, norm=None, residual=None):
                calls.append(("norm" if norm is not None else "") + ("residual" if residual is not None else ""))
                y = F.linear(norm(x) if norm is not None else x, layer.weight, bias)
                return y if residual is None else residual + y

        return FoldingDense()


@pytest.mark.parametrize("family,folding", [("llama", "all"), ("llama", "qkv"), ("qwen3", "all")])
def test_a_format_that_folds_the_norms_and_residual_adds_gives_the_same_model(tmp_path, family, folding):
    """LlamaDecoderLayer's folded form (LinearMethod.folds_norm / adds_residual: the input norm
    handed to the QKV and gate/up projections, the residual added by the output and down
    projections, the layer returning the residual stream itself) leaves every logit and greedy
    choice of a mixed prefill/decode schedule unchanged; the prefill steps keep the plain form.
    With only the QKV projection's format folding ("qkv"), the others fall back on their own
    (the norm applied by the layer, the residual added after the product); Qwen3 (q/k norms
    before the rotation) takes the unrotated projection."""
    from tests.helpers import load_tiny, run_schedule, tiny_model_dir

    path = tiny_model_dir(tmp_path, family)
    want = run_schedule(load_tiny(path), vocab=128, decode_steps=3)
    model = load_tiny(path)
    calls = []
    kinds = (QKVParallelLinear,) if folding == "qkv" else (ColumnParallelLinear, RowParallelLinear)
    for m in model.modules():
        if isinstance(m, kinds):
            m.linear_method = _FoldingDense(calls)
    got = run_schedule(model, vocab=128, decode_steps=3)
    layers = len(model.model.layers)
    # The three decode-only steps fold, every layer; steps 1 and 2 (prefill chunks) do not.
    folds = 2 if folding == "all" else 1
    assert calls.count("norm") == folds * layers * 3, calls
    assert calls.count("residual") == (2 * layers * 3 if folding == "all" else 0), calls
    assert calls.count("") == (4 if folding == "all" else 1) * layers * 2, calls  # the prefill steps
    for s in want:
        assert got[s][0] == want[s][0]
        assert torch.equal(got[s][1].argmax(-1), want[s][1].argmax(-1))
        torch.testing.assert_close(got[s][1], want[s][1], rtol=1e-5, atol=1e-5)


def test_linear_layers_apply_a_norm_or_residual_their_format_does_not_take():
    """The dense format folds nothing: ColumnParallelLinear(x, norm) is F.linear of norm(x),
    RowParallelLinear(x, residual) is residual + F.linear(x) (bias included), bit for bit."""
    w, b, x, r = rand(24, 16, seed=1), rand(24, seed=2), rand(2, 16, seed=3), rand(2, 24, seed=4)
    norm = RMSNorm(16, 1e-6, ctx_for())
    norm.load_weight("weight", rand(16, seed=5))
    col = ColumnParallelLinear(16, 24, ctx_for())
    col.load_weight("weight", w)
    assert torch.equal(col(x, norm), F.linear(norm(x), w))
    row = RowParallelLinear(16, 24, ctx_for(), bias=True)
    row.load_weight("weight", w)
    row.load_weight("bias", b)
    assert torch.equal(row(x, r), r + F.linear(x, w, b))
