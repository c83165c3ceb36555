"""Experiments built on the library, run from the repository root (`python -m experiments.stability`)."""
