"""Mistakes that mypy finds in a user's program (tests/test_typing.py counts them)."""

import jax.numpy as jnp

from ls_jax import ls_attention

q = jnp.zeros((2, 16, 4, 8))
ls_attention(q, q, q, (None, 4, 4, 4), implementation="flash")  # not a backend
ls_attention(q, q, q, (None, 4, 4, 4), scale="0.5")  # not a float
