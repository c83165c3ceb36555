"""The model: ``transformer`` (the decoder-only Transformer), ``attention`` (the LS-attention
layer), ``kv_cache`` (the decoding cache), ``rope`` (rotary embeddings)."""
