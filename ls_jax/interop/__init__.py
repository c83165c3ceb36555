"""LS-attention for other stacks and files for other tools: ``linen`` (a Flax Linen layer),
``attention_fn`` (Flax's attention layers), ``export`` (``jax.export``), ``weights``
(safetensors)."""
