"""GPT-2-style decoder with LS-attention: embeddings, pre-LayerNorm blocks, GELU MLP, LM head."""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ls_jax.kernels.dense import choose_dense_implementation, dense_residual, norm_dense
from ls_jax.layers.attention import LSAttention, check_positions, partitioned
from ls_jax.config import ModelConfig
from ls_jax.layers.kv_cache import CacheStep, KVCache, init_cache
from ls_jax.sharding import constrain_batch

# model.remat -> what a block keeps for its backward pass (None: no checkpointing)
REMAT_POLICIES = {
    "none": None,
    "full": jax.checkpoint_policies.nothing_saveable,
    "dots": jax.checkpoint_policies.dots_with_no_batch_dims_saveable,
}


def _dtype(name: str):
    return jnp.dtype(name)


def check_tokens(tokens_BxT, positions=None, segment_ids=None) -> None:
    """One line for tokens that are not int [B, T] or positions or segment ids that are not
    int [B, T]: the model's input, checked once per call (the blocks and their attention trust
    it)."""
    shape = tuple(getattr(tokens_BxT, "shape", ()))
    dtype = getattr(tokens_BxT, "dtype", None)
    if len(shape) != 2 or dtype is None or not jnp.issubdtype(dtype, jnp.integer):
        raise ValueError(f"tokens: expected int [B, T], got {dtype or type(tokens_BxT).__name__} "
                         f"{shape}")
    check_positions(shape, positions, segment_ids)


def check_table_length(seq_len, max_seq_len: int) -> None:
    """One line for a sequence longer than the learned position table, or a symbolic one
    (``jax.export.symbolic_shape``) not bounded by it."""
    try:
        too_long = seq_len > max_seq_len
    except jax.errors.InconclusiveDimensionOperation:
        raise ValueError(
            f"tokens: the symbolic sequence length {seq_len} may exceed model.max_seq_len="
            f"{max_seq_len} of the learned position table; add the constraint "
            f"'{seq_len} <= {max_seq_len}' to its jax.export.symbolic_shape(..., constraints=...)"
            ) from None
    if too_long:
        raise ValueError(
            f"tokens: sequence length {seq_len} exceeds model.max_seq_len={max_seq_len} of the "
            f"learned position table")


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, *, out_init_std: float, rngs: nnx.Rngs):
        hidden = cfg.mlp_ratio * cfg.d_model
        kw = dict(use_bias=cfg.use_bias, dtype=_dtype(cfg.compute_dtype),
                  param_dtype=_dtype(cfg.param_dtype), rngs=rngs)
        normal, zeros = nnx.initializers.normal, nnx.initializers.zeros_init()
        self.fc = nnx.Linear(cfg.d_model, hidden, **kw,
                             kernel_init=partitioned(normal(cfg.init_std), ("embed", "mlp")),
                             bias_init=partitioned(zeros, ("mlp",)))
        self.proj = nnx.Linear(hidden, cfg.d_model, **kw,
                               kernel_init=partitioned(normal(out_init_std), ("mlp", "embed")),
                               bias_init=partitioned(zeros, ("embed",)))

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
                 return_logit_stats: bool = False, cache: KVCache | None = None,
                 step: CacheStep | None = None, layer=0):
        """Returns (x, max_abs_logit_H or None, the updated KVCache or None).

        The statistics come with ``return_logit_stats`` (the attention kernel computes them
        only then); with ``cache`` and ``step`` the tokens at ``positions`` attend over layer
        ``layer`` of the KV cache and are written into it (``LSAttention.__call__``). A decode
        step (one token per row) runs ``decode_fused`` where
        ``kernels.dense.choose_dense_implementation`` picks the Pallas kernel.
        """
        if cache is not None and x_BxTxM.shape[1] == 1 and not step.fresh:
            B = x_BxTxM.shape[0]
            dense = choose_dense_implementation(B, dtype=self.compute_dtype,
                                                attention=self.attn.decode_backend(B, step),
                                                products=self.dense_products(x_BxTxM.dtype))
            if dense == "pallas_gpu":
                return self.decode_fused(x_BxTxM, positions, cache, step, layer)
        h = self.attn.forward(self.ln1(x_BxTxM).astype(self.compute_dtype), positions=positions,
                              segment_ids=segment_ids, return_logit_stats=return_logit_stats,
                              cache=cache, step=step, layer=layer)
        stats_H = None
        if cache is not None:
            h, cache = h
        elif return_logit_stats:
            h, stats_H = h
        x_BxTxM = x_BxTxM + h
        x_BxTxM = x_BxTxM + self.mlp(self.ln2(x_BxTxM).astype(self.compute_dtype))
        return x_BxTxM, stats_H, cache

    def dense_products(self, residual_dtype) -> tuple[tuple[int, int], ...]:
        """(bytes of a row of x, output columns) of each launch of ``decode_fused``: the
        LayerNorms read the residual stream (``residual_dtype``) twice (statistics, then the
        product), the output projections their input once in the compute dtype."""
        d, c = self.ln1.num_features, self.compute_dtype.itemsize
        r = 2 * d * jnp.dtype(residual_dtype).itemsize
        attn, hidden = self.attn, self.mlp.fc.out_features
        qkv = sum(m.out_features for m in attn.projections)
        return ((r, qkv), (attn.o_proj.in_features * c, d), (r, hidden), (hidden * c, d))

    def decode_fused(self, x_Bx1xM, positions_Bx1, cache: KVCache, step: CacheStep, layer):
        """``__call__``'s decode step (one new token per row) with each LayerNorm and the
        products that read it, and each product and the residual added to it, as one
        ``kernels.dense`` launch (pallas_gpu): the flax modules' arithmetic."""
        B = x_Bx1xM.shape[0]
        attn, mlp = self.attn, self.mlp
        kw = dict(compute_dtype=self.compute_dtype, implementation="pallas_gpu",
                  interpret=attn.interpret)
        x_BxM = x_Bx1xM[:, 0]
        q_BxN, k_BxN, v_BxN = norm_dense(
            x_BxM, *_norm_params(self.ln1), [m.kernel[...] for m in attn.projections],
            _biases(attn.projections), eps=self.ln1.epsilon, **kw)
        D = attn.head_dim
        out_BxHxD, cache = attn.decode_heads(
            q_BxN.reshape(B, 1, -1, D), k_BxN.reshape(B, 1, -1, D),
            v_BxN.reshape(B, 1, -1, D), cache, layer, positions_Bx1, step)
        x_BxM = dense_residual(out_BxHxD.reshape(B, -1), attn.o_proj.kernel[...],
                               _bias(attn.o_proj), x_BxM, **kw)
        (h_BxF,) = norm_dense(x_BxM, *_norm_params(self.ln2), [mlp.fc.kernel[...]],
                              _biases([mlp.fc]), eps=self.ln2.epsilon, activation="gelu_tanh",
                              **kw)
        x_BxM = dense_residual(h_BxF, mlp.proj.kernel[...], _bias(mlp.proj), x_BxM, **kw)
        return x_BxM[:, None], None, cache


def _bias(linear: nnx.Linear):
    return None if linear.bias is None else linear.bias[...]


def _biases(linears):
    return None if linears[0].bias is None else [m.bias[...] for m in linears]


def _norm_params(ln: nnx.LayerNorm):
    """(scale, shift) of a LayerNorm, ones or zeros where it has none."""
    d = ln.num_features
    return (jnp.ones((d,), jnp.float32) if ln.scale is None else ln.scale[...],
            jnp.zeros((d,), jnp.float32) if ln.bias is None else ln.bias[...])


def init_blocks(cfg: ModelConfig, key: jax.Array) -> list[Block]:
    """``cfg.n_layer`` fresh Blocks, each from its own key split from ``key``, drawn together:
    each parameter's random draw is one operation over every layer (``jax.vmap``), so a jitted
    init compiles as many draws for 2 layers as for 100."""
    graphdef = None

    def one(k):
        nonlocal graphdef
        graphdef, state = nnx.split(Block(cfg, rngs=nnx.Rngs(params=k)))
        return state

    stacked = jax.vmap(one)(jax.random.split(key, cfg.n_layer))
    # one buffer per parameter kind before the per-layer slices, so that XLA does not fuse the
    # draw into each layer's slice (a copy of the random-number code per layer)
    stacked = jax.lax.optimization_barrier(stacked)
    return [nnx.merge(graphdef, jax.tree.map(lambda x: x[i], stacked))
            for i in range(cfg.n_layer)]


def stack_blocks(blocks) -> tuple[nnx.GraphDef, nnx.State]:
    """(the Blocks' common graphdef, their states stacked along a leading layer axis): what
    ``jax.lax.scan`` runs over."""
    graphdef, first = nnx.split(blocks[0])
    states = [first] + [nnx.split(b)[1] for b in blocks[1:]]
    return graphdef, jax.tree.map(lambda *xs: jnp.stack(xs), *states)


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
        self.embed = nnx.Embed(cfg.vocab_size, cfg.d_model,
                               embedding_init=partitioned(emb_init, ("vocab", "embed")),
                               param_dtype=pdt, rngs=rngs)
        self.pos_embed = (nnx.Embed(cfg.max_seq_len, cfg.d_model,
                                    embedding_init=partitioned(emb_init, ("positions", "embed")),
                                    param_dtype=pdt, rngs=rngs)
                          if cfg.pos_embedding == "learned" else None)
        self.blocks = nnx.List(init_blocks(cfg, rngs.params()))
        self.ln_f = nnx.LayerNorm(cfg.d_model, use_bias=cfg.use_bias, dtype=jnp.float32,
                                  param_dtype=pdt, rngs=rngs)
        self.lm_head = (None if cfg.tie_embeddings else
                        nnx.Linear(cfg.d_model, cfg.vocab_size, use_bias=False,
                                   kernel_init=partitioned(emb_init, ("embed", "vocab")),
                                   dtype=_dtype(cfg.compute_dtype),
                                   param_dtype=pdt, rngs=rngs))

    def __call__(self, tokens_BxT: jax.Array, *, positions: jax.Array | None = None,
                 segment_ids: jax.Array | None = None, return_stats: bool = False):
        cfg = self.cfg
        check_tokens(tokens_BxT, positions, segment_ids)
        B, T = tokens_BxT.shape
        if positions is None:
            positions = jnp.broadcast_to(jnp.arange(T, dtype=jnp.int32), (B, T))
        if self.pos_embed is not None:
            check_table_length(T, cfg.max_seq_len)
        # the residual stream: batch-split, model dims whole
        x_BxTxM = constrain_batch(self._embed(tokens_BxT, positions))
        x_BxTxM, max_abs_logit_LxH, _ = self._scan_blocks(
            x_BxTxM, positions=positions, segment_ids=segment_ids, return_stats=return_stats)
        logits_BxTxV = self._logits(x_BxTxM)
        if not return_stats:
            return logits_BxTxV
        stats = {
            "attn_max_abs_logit": max_abs_logit_LxH,
            "lm_head_max_abs_logit": jax.lax.stop_gradient(jnp.max(jnp.abs(logits_BxTxV))),
        }
        return logits_BxTxV, stats

    def _embed(self, tokens_BxT, positions_BxT):
        """The token embeddings (plus the learned position table's rows), float32."""
        x_BxTxM = self.embed(tokens_BxT).astype(jnp.float32)
        if self.pos_embed is not None:
            x_BxTxM = x_BxTxM + self.pos_embed(positions_BxT).astype(jnp.float32)
        return x_BxTxM

    def _logits(self, x_BxTxM):
        """The final LayerNorm and the LM head (the embedding's transpose when tied): float32
        logits."""
        h_BxTxM = self.ln_f(x_BxTxM).astype(_dtype(self.cfg.compute_dtype))
        if self.lm_head is None:
            return self.embed.attend(h_BxTxM).astype(jnp.float32)
        return self.lm_head(h_BxTxM).astype(jnp.float32)

    def _scan_blocks(self, x_BxTxM, *, positions, segment_ids=None, return_stats: bool = False,
                     cache: KVCache | None = None, step: CacheStep | None = None):
        """The blocks as one ``jax.lax.scan`` over their stacked parameters and layer
        indices, traced once (the block and its attention kernels are lowered once whatever
        the depth) and unrolled in the compiled program: XLA fuses and schedules across
        unrolled blocks, where a rolled loop pays each step for slicing the stacked parameters
        and carrying its buffers. Training, evaluation and decoding all run it; a decoding
        ``cache`` (every layer's, ``KVCache``) rides in the carry, and block l reads and writes
        its layer l in place. Returns (x, max_abs_logit [L, H] or None, the updated cache or
        None); ``model.remat`` checkpoints each block of a pass without a cache."""
        graphdef, stacked = stack_blocks(self.blocks)

        def body(carry, xs):
            x_BxTxM, cache = carry
            state, layer = xs
            x_BxTxM, stats_H, cache = nnx.merge(graphdef, state)(
                x_BxTxM, positions=positions, segment_ids=segment_ids,
                return_logit_stats=return_stats, cache=cache, step=step, layer=layer)
            return (constrain_batch(x_BxTxM), cache), stats_H

        policy = REMAT_POLICIES[self.cfg.remat]
        if policy is not None and cache is None:  # the backward recomputes what it drops
            body = jax.checkpoint(body, policy=policy, prevent_cse=False)
        # the layer indices as constants: each unrolled block then reads and writes a static
        # slice of the cache
        layers = np.arange(len(self.blocks), dtype=np.int32)
        (x_BxTxM, cache), stats_LxH = jax.lax.scan(body, (x_BxTxM, cache), (stacked, layers),
                                                   unroll=True)
        return x_BxTxM, stats_LxH, cache

    # -- decoding with a KV cache (ls_jax/inference/generate.py) ---------------------------------------

    def init_cache(self, batch_size: int, max_len: int, dtype=jnp.bfloat16):
        """An empty ``KVCache`` for ``batch_size`` rows of up to ``max_len`` positions (the
        blocks share one layout: one config, scanned)."""
        return init_cache(self.blocks[0].attn.cache_layout, len(self.blocks), batch_size,
                          max_len, self.cfg.head_dim, dtype)

    def decode(self, tokens_BxC: jax.Array, cache, *, positions_BxC: jax.Array,
               new_lengths_B: jax.Array, fresh: bool = False,
               logits_index_B: jax.Array | None = None,
               decode_implementation: str | None = None):
        """Runs C new tokens per row through the model with the KV cache.

        positions_BxC: their positions; tokens at positions >= new_lengths_B are padding.
        new_lengths_B: positions written per row after this call (the cache's lengths_B before
          it are the old ones).
        fresh: the cache is empty and positions are 0 .. C-1 in every row (the first
          prefill chunk; attention via ``ls_attention``).
        logits_index_B: return only the logits of token ``logits_index_B[b]`` of each row
          ([B, vocab]) instead of all of them ([B, C, vocab]).
        Returns (float32 logits, the updated KVCache).
        """
        # padding may sit past the learned position table: clamp (its rows are never read)
        x_BxCxM = self._embed(tokens_BxC, jnp.minimum(positions_BxC, self.cfg.max_seq_len - 1))
        step = CacheStep(cache.lengths_B, new_lengths_B, fresh, decode_implementation)
        x_BxCxM, _, cache = self._scan_blocks(x_BxCxM, positions=positions_BxC, cache=cache,
                                              step=step)
        if logits_index_B is not None:
            x_BxCxM = jnp.take_along_axis(x_BxCxM, logits_index_B[:, None, None], axis=1)
        logits = self._logits(x_BxCxM)
        if logits_index_B is not None:
            logits = logits[:, 0]
        return logits, cache._replace(lengths_B=new_lengths_B.astype(jnp.int32))


def count_params(model: nnx.Module) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
