"""Small random-weight Llama models for fast decoding tests."""

import torch

from specdec_kernels.model import Llama, LlamaConfig


def tiny_config(vocab_size=97, layers=2, hidden=64, heads=4, kv_heads=2, **overrides) -> LlamaConfig:
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
