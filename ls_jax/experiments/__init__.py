"""Experiments built on the library (stability: the paper's logit-growth comparison)."""
