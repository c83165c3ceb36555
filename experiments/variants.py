"""The stability experiments' variants: which named config each runs, and what sets them apart.

Kept apart from the experiments themselves so that every one of them (``stability``, which
trains through ``ls_jax.training.train``, and ``lr_sweep`` / ``paper_batch``, which run on a GPU image
without grain) reads the same table.
"""

# variant (its name in outputs) -> the named config it runs (configs/paper.py)
VARIANT_CONFIGS = {"ls": "paper", "mhsa": "paper_mhsa", "mhsa_qknorm": "paper_qknorm",
                   "mhsa_zloss": "paper_zloss"}
VARIANTS = tuple(VARIANT_CONFIGS)
# what the variants differ in: a preset or an override must leave these alone
VARIANT_KEYS = ("model.n_head", "model.n_global_heads", "model.qk_norm", "train.z_loss")


def config_name(variant: str, overrides=()) -> str:
    """The named config of ``variant``; ValueError for an unknown variant or for overrides that
    touch ``VARIANT_KEYS``."""
    if variant not in VARIANT_CONFIGS:
        raise ValueError(f"variants: expected names from {VARIANTS}, got {variant!r}")
    touched = [o for o in overrides if o.split("=", 1)[0].strip() in VARIANT_KEYS]
    if touched:
        raise ValueError(f"overrides: expected none of {VARIANT_KEYS} (they define the "
                         f"variants), got {touched}")
    return VARIANT_CONFIGS[variant]
