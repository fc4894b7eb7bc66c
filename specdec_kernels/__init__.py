"""specdec_kernels: fast, lossless speculative decoding.

Fused Triton kernels for the hot spots of speculative decoding (rejection
sampling, first-rejection search, causal attention over a ragged KV cache),
a vectorized sync-free CPU path for each op, plain-PyTorch references that
prove them right, and a decoding API on top that takes the built-in `Llama` or a
Hugging Face causal LM (`HFCausalLM`).

Every op takes ``backend="auto" | "reference" | "torch" | "triton"``; see
`specdec_kernels._backend`.
"""

from ._backend import BACKENDS, auto_backend, interpreter_enabled, resolve_backend, triton_available
from ._checks import DeviceCheckError
from .attention import RaggedAttentionPlan, ragged_attention
from .cache import KVCache
from .draft_heads import ExitHead, ExitHeadDraft, FeatureHead, FeatureHeadDraft
from .drafts import Drafter, DraftProposal, EarlyExitDraft, LookupFirstDraft, ModelDraft, PromptLookupDraft
from .generation import GenerationOutput, GenerationStats, generate, speculative_generate
from .jacobi import jacobi_generate
from .lookahead import lookahead_generate
from .matmul import MatmulPlan
from .model import Llama, LlamaConfig
from .pretrained import load_gemma3_270m, load_smollm2, load_smollm2_draft
from .sampling import (
    RejectionNoise,
    RejectionOutput,
    first_rejection_index,
    make_rejection_noise,
    process_logits,
    rejection_sample,
    rejection_sample_logits,
    sample_logits,
)
from .tree_sampling import TreeRejectionOutput, tree_rejection_sample

__version__ = "0.1.0"

__all__ = [
    "BACKENDS",
    "DeviceCheckError",
    "DraftProposal",
    "Drafter",
    "EarlyExitDraft",
    "ExitHead",
    "ExitHeadDraft",
    "FeatureHead",
    "FeatureHeadDraft",
    "GenerationOutput",
    "GenerationStats",
    "Llama",
    "LlamaConfig",
    "LookupFirstDraft",
    "MatmulPlan",
    "ModelDraft",
    "PromptLookupDraft",
    "RaggedAttentionPlan",
    "KVCache",
    "RejectionNoise",
    "RejectionOutput",
    "TreeRejectionOutput",
    "__version__",
    "auto_backend",
    "first_rejection_index",
    "generate",
    "interpreter_enabled",
    "jacobi_generate",
    "lookahead_generate",
    "load_gemma3_270m",
    "load_smollm2",
    "load_smollm2_draft",
    "make_rejection_noise",
    "process_logits",
    "ragged_attention",
    "rejection_sample",
    "rejection_sample_logits",
    "resolve_backend",
    "sample_logits",
    "speculative_generate",
    "tree_rejection_sample",
    "triton_available",
]


def __getattr__(name: str):
    # transformers is imported only by those who use it: `HFCausalLM` registers an attention
    # function with it (`specdec_kernels.hf`).
    if name == "HFCausalLM":
        from .hf import HFCausalLM

        return HFCausalLM
    raise AttributeError(f"module 'specdec_kernels' has no attribute {name!r}")
