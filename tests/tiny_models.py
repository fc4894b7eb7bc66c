"""Small random-weight Llama models for fast decoding tests."""

import torch

from specdec_kernels.model import Llama, LlamaConfig

V = 97  # the tiny models' vocabulary


def tiny_config(vocab_size=V, layers=2, hidden=64, heads=4, kv_heads=2, **overrides) -> LlamaConfig:
    return LlamaConfig(vocab_size=vocab_size, hidden_size=hidden, intermediate_size=2 * hidden + 16,
                       num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads,
                       rope_theta=10000.0, max_position_embeddings=512, **overrides)


def tiny_llama(seed: int = 0, scale: float = 1.0, **config) -> Llama:
    """A random Llama whose logits are spread widely enough (``scale``) for sampling tests."""
    generator = torch.Generator().manual_seed(seed)
    model = Llama(tiny_config(**config))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.copy_(torch.randn(p.shape, generator=generator) * scale / p.shape[-1] ** 0.5)
    return model.eval()


def ragged_prompts(B=6, P=9, seed=0, left=True):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, V, (B, P), generator=g)
    lengths = torch.randint(1, P + 1, (B,), generator=g)
    lengths[0] = P
    positions = torch.arange(P)
    mask = positions >= P - lengths[:, None] if left else positions < lengths[:, None]
    return torch.where(mask, ids, 0), mask.long()


def greedy_divergence_allowed(model, input_ids, mask, tokens, row, position, gap=1e-4) -> bool:
    """Whether the target's top-2 logit gap at ``position`` of ``row`` is below ``gap``.

    Plain and speculative decoding compute the same logits with different batch shapes (T=1
    vs T=K+1 queries), so fp32 rounding differs by ~1e-6 relative; a gap 100x above that
    cannot flip an argmax, so any divergence where the gap is larger is a real bug."""
    prompt = input_ids[row][mask[row].bool()]
    ids = torch.cat([prompt, tokens[row, :position]])[None]
    with torch.no_grad():
        logits = model(ids, model.new_cache(1, ids.shape[1]))[0, -1]
    top2 = logits.topk(2).values
    return bool(top2[0] - top2[1] < gap)
