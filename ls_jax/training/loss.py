"""Language-model loss: token cross-entropy, plus the optional z-loss baseline."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def lm_loss(logits_BxTxV: jax.Array, targets_BxT: jax.Array, *, z_loss: float = 0.0):
    """Returns (loss, {"ce": mean cross-entropy (nats/token), "z": mean logsumexp^2}).

    loss = ce + z_loss * mean(logsumexp(logits)^2); the z term is the regulariser that keeps
    the output logits' normaliser near 0 (PaLM; tried by the LS-attention paper's author).
    """
    logits_BxTxV = logits_BxTxV.astype(jnp.float32)
    lse_BxT = jax.nn.logsumexp(logits_BxTxV, axis=-1)
    target_logit_BxT = jnp.take_along_axis(logits_BxTxV, targets_BxT[..., None], axis=-1)[..., 0]
    ce_BxT = lse_BxT - target_logit_BxT
    n_tokens = ce_BxT.size
    ce = ce_BxT.sum() / n_tokens
    z = jnp.square(lse_BxT).sum() / n_tokens
    loss = ce + z_loss * z if z_loss else ce
    return loss, {"ce": ce, "z": z}
