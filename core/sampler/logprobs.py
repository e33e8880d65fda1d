"""Logprobs: the top-k raw logprobs of sampled rows, and prompt logprobs.

Logprobs are ``log_softmax`` of the *raw* model logits (vLLM's default ``raw_logprobs``
mode): what the model thinks, before penalties, bias, temperature and filters. Reading them
back is the one place the sampler waits for the device on purpose.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from core.outputs import Logprob
from core.sampler.rows import Scratch


def top_logprobs(
    logits: torch.Tensor,
    lse: torch.Tensor,
    tokens: torch.Tensor,
    ks: Sequence[int | None],
    ws: Scratch,
) -> list[dict[int, Logprob] | None]:
    """Per row with k set: the k largest log_softmax entries (ranks 1..k) plus ``tokens``'
    entry with rank 1 + the number of strictly more likely tokens."""
    out: list[dict[int, Logprob] | None] = [None] * len(ks)
    picks = [i for i, k in enumerate(ks) if k is not None]
    idx = torch.tensor(picks, dtype=torch.int64, device=logits.device)
    x = ws.rows("work", logits, idx)
    kmax = min(max(ks[i] for i in picks), x.shape[1])
    top_vals, top_ids = x.topk(kmax, dim=-1)
    top_lp = (top_vals - lse[idx, None]).tolist()
    chosen = x.gather(1, tokens[idx, None])
    ranks = (torch.gt(x, chosen, out=ws.get("mask", x.shape, x, torch.bool)).sum(-1) + 1).tolist()
    chosen_lp = (chosen[:, 0] - lse[idx]).tolist()
    top_ids_l, token_l = top_ids.tolist(), tokens.tolist()
    for n, i in enumerate(picks):
        k = min(ks[i], kmax)
        d = {
            t: Logprob(lp, r + 1) for r, (t, lp) in enumerate(zip(top_ids_l[n][:k], top_lp[n][:k]))
        }
        tok = token_l[i]
        if tok not in d:
            d[tok] = Logprob(chosen_lp[n], ranks[n])
        out[i] = d
    return out


def prompt_logprobs(
    logits: torch.Tensor, next_token_ids: torch.Tensor, k: int
) -> list[dict[int, Logprob]]:
    """Logprobs of a prompt: position i's logits scored against the prompt token i + 1.

    :param logits: [N, V] logits of N prompt positions
    :param next_token_ids: [N] the token that actually follows each position
    :param k: how many top entries to add besides the actual token (0 = only it)
    :return: per position, ``{token: Logprob}`` with the top-k (ranks 1..k) and the actual
        next token (its true rank)
    """
    if logits.dim() != 2 or next_token_ids.shape != (logits.shape[0],):
        raise ValueError(
            f"prompt_logprobs needs logits [N, V] and next_token_ids [N]; got "
            f"{tuple(logits.shape)} and {tuple(next_token_ids.shape)}"
        )
    if logits.shape[0] == 0:
        return []
    logits = logits.float()
    lse = torch.logsumexp(logits, dim=-1)
    tokens = next_token_ids.to(device=logits.device, dtype=torch.int64)
    per_pos = top_logprobs(logits, lse, tokens, [k] * logits.shape[0], Scratch())
    return [d for d in per_pos if d is not None]
