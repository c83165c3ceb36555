"""Inference: ``generate`` (KV-cache decoding) and ``sample`` (the sampling CLI)."""
