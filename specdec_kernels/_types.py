"""Types and constants shared by the sampler's backends (reference, torch path, Triton kernels).

Imports torch only: the reference and the kernels both import it, and neither imports the other.
The public names are exported by `specdec_kernels` and `specdec_kernels.sampling`.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

#: Vocabulary entries per chunk in the two-level inverse-CDF sampler of the reference and torch paths.
SAMPLE_CHUNK = 256

#: Floating dtypes the samplers accept for probabilities and logits.
FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


class RejectionOutput(NamedTuple):
    """Result of `rejection_sample` / `rejection_sample_logits`.

    Attributes:
        token_ids: ``[B, K+1]`` int64: the accepted drafts, then one corrected or bonus token,
            then ``-1`` padding.
        num_accepted: ``[B]`` int64: accepted drafts per row (``0..n_b``); each row emits
            ``num_accepted + 1`` tokens.
    """

    token_ids: torch.Tensor
    num_accepted: torch.Tensor


class RejectionNoise(NamedTuple):
    """Explicit random inputs of the rejection sampler, for reproducible and exact tests.

    Attributes:
        accept: ``[B, K]`` float32 in ``(0, 1]``: the acceptance uniform of each draft position.
        uniform: ``[B, 2]`` float32 in ``[0, 1)``, or None: the two uniforms of the two-level
            inverse-CDF draw (chunk, then entry) consumed by the ``"reference"`` and ``"torch"``
            backends.
        exponential: ``[B, V]`` float32 ``> 0``, or None: Exp(1) variables of the exponential race
            (``argmax w / E``) consumed by the ``"triton"`` backend. The reference uses the race
            when this is given, and the two-level draw otherwise.
    """

    accept: torch.Tensor
    uniform: torch.Tensor | None = None
    exponential: torch.Tensor | None = None
