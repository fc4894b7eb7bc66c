"""SmolLM2-135M's shapes, for the diagnostics' random-weight models (ours and transformers')."""

SMOLLM2_SHAPE = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                     num_attention_heads=9, num_key_value_heads=3, tie_word_embeddings=True)
