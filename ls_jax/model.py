"""GPT-2-style decoder with LS-attention: embeddings, pre-LayerNorm blocks, GELU MLP, LM head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from ls_jax.attention import LSAttention
from ls_jax.config import ModelConfig


def _dtype(name: str):
    return jnp.dtype(name)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, out_init_std: float, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.d_model
        kw = dict(use_bias=cfg.use_bias, dtype=_dtype(cfg.compute_dtype),
                  param_dtype=_dtype(cfg.param_dtype), rngs=rngs)
        self.fc = nnx.Linear(cfg.d_model, hidden, kernel_init=nnx.initializers.normal(cfg.init_std), **kw)
        self.proj = nnx.Linear(hidden, cfg.d_model, kernel_init=nnx.initializers.normal(out_init_std), **kw)

    def __call__(self, x_BxTxM):
        return self.proj(jax.nn.gelu(self.fc(x_BxTxM), approximate=True))


class Block(nnx.Module):
    """Pre-LayerNorm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        # GPT-2: residual projections start smaller, by 1 / sqrt(2 * n_layer)
        out_std = cfg.init_std / math.sqrt(2 * cfg.n_layer)
        norm = dict(use_bias=cfg.use_bias, dtype=jnp.float32, param_dtype=_dtype(cfg.param_dtype),
                    rngs=rngs)
        self.ln1 = nnx.LayerNorm(cfg.d_model, **norm)
        self.attn = LSAttention(
            cfg.d_model, cfg.n_head, cfg.head_dim, n_kv_head=cfg.kv_heads,
            window_sizes=cfg.window_sizes, qk_norm=cfg.qk_norm, use_bias=cfg.use_bias,
            rope_theta=cfg.rope_theta if cfg.pos_embedding == "rope" else None,
            dtype=_dtype(cfg.compute_dtype), param_dtype=_dtype(cfg.param_dtype),
            implementation=cfg.attn_implementation, init_std=cfg.init_std, out_init_std=out_std,
            rngs=rngs)
        self.ln2 = nnx.LayerNorm(cfg.d_model, **norm)
        self.mlp = MLP(cfg, out_init_std=out_std, rngs=rngs)
        self.compute_dtype = _dtype(cfg.compute_dtype)

    def __call__(self, x_BxTxM, *, positions=None, segment_ids=None,
                 return_logit_stats: bool = False):
        """Returns x, or (x, max_abs_logit_H) with ``return_logit_stats`` (the attention
        kernel computes the statistics only then)."""
        attn = self.attn(self.ln1(x_BxTxM).astype(self.compute_dtype), positions=positions,
                         segment_ids=segment_ids, return_logit_stats=return_logit_stats)
        h_BxTxM, max_abs_logit_H = attn if return_logit_stats else (attn, None)
        x_BxTxM = x_BxTxM + h_BxTxM
        x_BxTxM = x_BxTxM + self.mlp(self.ln2(x_BxTxM).astype(self.compute_dtype))
        if return_logit_stats:
            return x_BxTxM, max_abs_logit_H
        return x_BxTxM


class Transformer(nnx.Module):
    """Decoder-only LM. ``model(tokens_BxT)`` -> float32 logits [B, T, vocab].

    With ``return_stats=True`` also returns the logit-norm metrics of this forward pass:
    ``{"attn_max_abs_logit": [n_layer, n_head], "lm_head_max_abs_logit": []}`` (float32, no
    gradient): max |pre-softmax attention logit| per layer and head over batch and allowed
    pairs, and max |LM-head logit|.
    """

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        self.cfg = cfg
        pdt = _dtype(cfg.param_dtype)
        emb_init = nnx.initializers.normal(cfg.init_std)
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model, embedding_init=emb_init,
                               param_dtype=pdt, rngs=rngs)
        self.pos_embed = (nnx.Embed(cfg.max_seq_len, cfg.d_model, embedding_init=emb_init,
                                    param_dtype=pdt, rngs=rngs)
                          if cfg.pos_embedding == "learned" else None)
        self.blocks = nnx.List([Block(cfg, rngs=rngs) for _ in range(cfg.n_layer)])
        self.ln_f = nnx.LayerNorm(cfg.d_model, use_bias=cfg.use_bias, dtype=jnp.float32,
                                  param_dtype=pdt, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                   kernel_init=emb_init, dtype=_dtype(cfg.compute_dtype),
                                   param_dtype=pdt, rngs=rngs))

    def __call__(self, tokens_BxT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_stats: bool = False):
        cfg = self.cfg
        B, T = tokens_BxT.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if self.pos_embed is not None and T > cfg.max_seq_len:
            raise ValueError(
                f"tokens: sequence length {T} exceeds model.max_seq_len={cfg.max_seq_len} of the "
                f"learned position table")
        x_BxTxM = self.embed(tokens_BxT).astype(jnp.float32)
        if self.pos_embed is not None:
            x_BxTxM = x_BxTxM + self.pos_embed(positions).astype(jnp.float32)
        max_abs_logit_LxH = []
        for block in self.blocks:
            out = block(x_BxTxM, positions=positions, segment_ids=segment_ids,
                        return_logit_stats=return_stats)
            if return_stats:
                x_BxTxM, max_abs_logit_H = out
                max_abs_logit_LxH.append(max_abs_logit_H)
            else:
                x_BxTxM = out
        h_BxTxM = self.ln_f(x_BxTxM).astype(_dtype(cfg.compute_dtype))
        if self.lm_head is None:
            logits_BxTxV = self.embed.attend(h_BxTxM)
        else:
            logits_BxTxV = self.lm_head(h_BxTxM)
        logits_BxTxV = logits_BxTxV.astype(jnp.float32)
        if not return_stats:
            return logits_BxTxV
        stats = {
            "attn_max_abs_logit": jnp.stack(max_abs_logit_LxH),
            "lm_head_max_abs_logit": jax.lax.stop_gradient(jnp.max(jnp.abs(logits_BxTxV))),
        }
        return logits_BxTxV, stats


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
