"""Sampling: logits in, one token (and its logprobs) per row out.

One module per stage: :mod:`~core.sampler.rows` (the narrow row type and per-call
parameters), :mod:`~core.sampler.processors` (min_tokens, logit bias, penalties),
:mod:`~core.sampler.filters` (top-k, top-p, min-p), :mod:`~core.sampler.draw` (uniforms and
the inverse CDF), :mod:`~core.sampler.logprobs`, :mod:`~core.sampler.sampler` (the
pipeline), :mod:`~core.sampler.kernel` (the contract of a platform's fused kernel that
replaces the pipeline in one launch, e.g. csrc/sampling on CUDA), and
:mod:`~core.sampler.padding` (sampled rows padded to a static-shape device's bucket).
"""

from core.sampler.logprobs import prompt_logprobs
from core.sampler.rows import SampleRow, Staging
from core.sampler.sampler import Drawn, Sampler, SamplerOutput

__all__ = ["Drawn", "SampleRow", "Sampler", "SamplerOutput", "Staging", "prompt_logprobs"]
