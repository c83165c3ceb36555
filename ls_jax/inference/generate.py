"""Text generation with a KV cache: batched, chunked prefill, then a jitted decode loop.

    from ls_jax.inference.generate import generate
    result = generate(model, [prompt_ids_a, prompt_ids_b], max_new_tokens=64,
                      temperature=0.8, top_k=40, top_p=0.95, seed=0, end_id=0)
    result.tokens  # list of int32 arrays: the new tokens of each prompt (end id excluded)

Prompts of different lengths share one batch, **right-padded**: every row keeps positions
0, 1, ... (as if decoded alone), padding sits after a row's last prompt token where causal
attention keeps it out of every real query, and the cache only ever serves slots below each
row's length (``ls_jax/layers/kv_cache.py``). The prompt goes through the model in chunks of
``chunk_size`` tokens: the first chunk with ``ls_attention`` (the full-sequence kernel of the
model's backend), later chunks reading the cache through ``kernels.decode.cached_attention``.
Then one token per row and step: a ``jax.lax.while_loop`` that samples, stops at
``max_new_tokens`` or when every row produced ``end_id``, and runs the decode step (local
heads read only their ring buffer of p slots).

Positions. With learned positions a sequence (prompt + new tokens) cannot exceed
``model.max_seq_len``. With RoPE (or no positions) generation may run past the trained
length: local heads still only see relative offsets below their window, exactly as in
training, but global heads then see query-key offsets larger than any seen in training
(rotation angles never trained on); quality can degrade there, the computation stays exact.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from ls_jax.layers.kv_cache import KVCache


@dataclasses.dataclass
class GenerationResult:
    tokens: list[np.ndarray]  # per prompt: the generated ids (int32), up to and without end_id
    prompt_lengths: list[int]
    prefill_seconds: float  # cache allocation and prefill, compilation included
    compile_seconds: float  # compiling the decode loop
    decode_seconds: float  # the decode loop alone
    steps: int  # decode steps run (<= max_new_tokens)

    @property
    def num_generated(self) -> int:
        return sum(len(t) for t in self.tokens)


# -- sampling ---------------------------------------------------------------------------------

def sample_logits(logits_BxV: jax.Array, key: jax.Array, *, temperature: float = 0.0,
                  top_k: int | None = None, top_p: float | None = None) -> jax.Array:
    """int32 [B]: greedy (temperature 0) or a sample from softmax(logits / temperature)
    restricted to the top_k most likely tokens and to the smallest set whose probability
    reaches top_p."""
    if temperature == 0.0:
        return jnp.argmax(logits_BxV, axis=-1).astype(jnp.int32)
    logits_BxV = logits_BxV.astype(jnp.float32) / temperature
    if top_k is not None and top_k < logits_BxV.shape[-1]:
        kth_Bx1 = jax.lax.top_k(logits_BxV, top_k)[0][:, -1:]
        logits_BxV = jnp.where(logits_BxV < kth_Bx1, -jnp.inf, logits_BxV)
    if top_p is not None and top_p < 1.0:
        sorted_BxV = jnp.sort(logits_BxV, axis=-1)[:, ::-1]
        probs_BxV = jax.nn.softmax(sorted_BxV, axis=-1)
        before_BxV = jnp.cumsum(probs_BxV, axis=-1) - probs_BxV  # mass of the likelier tokens
        keep_BxV = before_BxV < top_p  # always keeps the most likely token
        threshold_Bx1 = jnp.min(jnp.where(keep_BxV, sorted_BxV, jnp.inf), axis=-1, keepdims=True)
        logits_BxV = jnp.where(logits_BxV < threshold_Bx1, -jnp.inf, logits_BxV)
    return jax.random.categorical(key, logits_BxV, axis=-1).astype(jnp.int32)


# -- jitted pieces ----------------------------------------------------------------------------

_FNS: dict[Any, Any] = {}


def split_flat(model: nnx.Module) -> tuple[tuple[Any, Any], list[jax.Array]]:
    """(structure, arrays): the model's graph and its state's tree structure, and the state's
    arrays as a list, which the jitted pieces below take. A call flattens a list of arrays
    without entering Python; an ``nnx.State`` it flattens in Python, Variable by Variable, on
    every call, and a short chunk or a batch-1 loop waits for that on the host."""
    graphdef, state = nnx.split(model)
    arrays, treedef = jax.tree.flatten(state)
    return (graphdef, treedef), arrays


def merge_flat(structure, arrays: Sequence[jax.Array]) -> nnx.Module:
    """The model of ``split_flat``'s (structure, arrays)."""
    graphdef, treedef = structure
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, arrays))


def prefill_compiler_options() -> dict | None:
    """XLA options for a prefill chunk on this platform. On GPU, XLA's dot merger computes a
    chunk's q, k and v projections as one matrix product and then copies each out of it, since
    the attention kernel takes each as a buffer of its own; as three products they are written
    where the kernel reads them. (Decode steps keep the merger: their products have a row per
    sequence, so the copies are small.)"""
    if jax.default_backend() == "gpu":
        return {"xla_disable_hlo_passes": "dot-merger"}
    return None


def prefill_chunk_fn(structure, *, fresh: bool, decode_implementation: str | None):
    """jit: (arrays, tokens_BxC, cache, chunk_start, prompt_lengths_B, last_logits_BxV)
    -> (last_logits_BxV, cache), for ``split_flat``'s (structure, arrays). last_logits takes
    the logits of each row's last prompt token when this chunk holds it. Call it at top level,
    not inside another jit: it carries ``prefill_compiler_options``."""
    key = ("prefill", structure, fresh, decode_implementation)
    if key not in _FNS:
        def fn(arrays, tokens_BxC, cache, chunk_start, prompt_lengths_B, last_logits_BxV):
            model = merge_flat(structure, arrays)
            B, C = tokens_BxC.shape
            positions_BxC = jnp.broadcast_to(chunk_start + jnp.arange(C, dtype=jnp.int32), (B, C))
            new_lengths_B = jnp.minimum(prompt_lengths_B, chunk_start + C)
            last_B = prompt_lengths_B - 1 - chunk_start
            logits_BxV, cache = model.decode(
                tokens_BxC, cache, positions_BxC=positions_BxC, new_lengths_B=new_lengths_B,
                fresh=fresh, logits_index_B=jnp.clip(last_B, 0, C - 1),
                decode_implementation=decode_implementation)
            here_B = (last_B >= 0) & (last_B < C)
            return jnp.where(here_B[:, None], logits_BxV, last_logits_BxV), cache
        _FNS[key] = jax.jit(fn, donate_argnums=(2,), compiler_options=prefill_compiler_options())
    return _FNS[key]


def decode_step(model, tokens_B, cache, *, decode_implementation: str | None):
    """(logits_BxV, cache) after one new token per row, at position ``cache.lengths_B``: the
    step of ``decode_loop_fn``'s loop (jit it with the cache donated to step on its own)."""
    lengths_B = cache.lengths_B
    return model.decode(tokens_B[:, None], cache, positions_BxC=lengths_B[:, None],
                        new_lengths_B=lengths_B + 1, logits_index_B=jnp.zeros_like(lengths_B),
                        decode_implementation=decode_implementation)


def decode_loop_fn(structure, *, max_new_tokens: int, temperature: float, top_k, top_p,
                   end_id: int | None, decode_implementation: str | None):
    """jit: (arrays, last_logits_BxV, cache, key) -> (tokens_BxN, steps, cache), for
    ``split_flat``'s (structure, arrays)."""
    key = ("loop", structure, max_new_tokens, temperature, top_k, top_p, end_id,
           decode_implementation)
    if key not in _FNS:
        def fn(arrays, logits_BxV, cache, rng):
            model = merge_flat(structure, arrays)
            B = logits_BxV.shape[0]
            fill = -1 if end_id is None else end_id
            tokens_BxN = jnp.full((B, max_new_tokens), fill, jnp.int32)

            def cond(carry):
                i, _, _, _, done_B = carry
                return (i < max_new_tokens) & ~jnp.all(done_B)

            def body(carry):
                i, logits_BxV, cache, tokens_BxN, done_B = carry
                tok_B = sample_logits(logits_BxV, jax.random.fold_in(rng, i),
                                      temperature=temperature, top_k=top_k, top_p=top_p)
                tok_B = jnp.where(done_B, fill, tok_B)
                tokens_BxN = jax.lax.dynamic_update_slice(tokens_BxN, tok_B[:, None], (0, i))
                if end_id is not None:
                    done_B = done_B | (tok_B == end_id)
                logits_BxV, cache = decode_step(model, jnp.maximum(tok_B, 0), cache,
                                                decode_implementation=decode_implementation)
                return i + 1, logits_BxV, cache, tokens_BxN, done_B

            carry = (jnp.int32(0), logits_BxV, cache, tokens_BxN, jnp.zeros((B,), bool))
            steps, _, cache, tokens_BxN, _ = jax.lax.while_loop(cond, body, carry)
            return tokens_BxN, steps, cache
        _FNS[key] = jax.jit(fn, donate_argnums=(2,))
    return _FNS[key]


# -- the API ----------------------------------------------------------------------------------

def _as_prompts(prompt_tokens, vocab_size: int) -> list[np.ndarray]:
    if isinstance(prompt_tokens, (np.ndarray, jax.Array)) and np.ndim(prompt_tokens) == 2:
        rows = [np.asarray(r) for r in np.asarray(prompt_tokens)]
    elif isinstance(prompt_tokens, (np.ndarray, jax.Array)) or (
            isinstance(prompt_tokens, Sequence) and prompt_tokens
            and all(np.isscalar(t) for t in prompt_tokens)):
        rows = [np.asarray(prompt_tokens)]
    elif isinstance(prompt_tokens, Sequence) and not isinstance(prompt_tokens, (str, bytes)):
        rows = [np.asarray(r) for r in prompt_tokens]
    else:
        raise ValueError(f"prompt_tokens: expected a sequence of token ids or a list of such "
                         f"sequences, got {type(prompt_tokens).__name__}")
    if not rows:
        raise ValueError("prompt_tokens: expected at least one prompt, got an empty list")
    for i, r in enumerate(rows):
        if r.ndim != 1 or r.size == 0:
            raise ValueError(f"prompt_tokens: expected non-empty 1-D token id sequences, "
                             f"prompt {i} has shape {r.shape}")
        if not np.issubdtype(r.dtype, np.integer):
            raise ValueError(f"prompt_tokens: expected integer token ids, prompt {i} has "
                             f"dtype {r.dtype}")
        if r.min() < 0 or r.max() >= vocab_size:
            raise ValueError(f"prompt_tokens: expected ids in [0, {vocab_size}), prompt {i} "
                             f"has min {r.min()} max {r.max()}")
    return [r.astype(np.int32) for r in rows]


def check_lengths(cfg, prompt_len: int, max_new_tokens: int, max_len: int | None) -> int:
    """The cache length for a longest prompt of ``prompt_len`` plus ``max_new_tokens``;
    raises ValueError when it does not fit the cache or the learned position table."""
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) \
            or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens: expected an int >= 1, got {max_new_tokens!r}")
    total = prompt_len + max_new_tokens
    if cfg.pos_embedding == "learned" and prompt_len >= cfg.max_seq_len:
        raise ValueError(
            f"prompt: {prompt_len} tokens leave no room for a new one in model.max_seq_len="
            f"{cfg.max_seq_len}, the learned position table (prompt and new tokens together); "
            f"expected a prompt of at most {cfg.max_seq_len - 1} tokens")
    if cfg.pos_embedding == "learned" and total > cfg.max_seq_len:
        raise ValueError(
            f"max_new_tokens: prompt ({prompt_len} tokens) + max_new_tokens ({max_new_tokens}) "
            f"= {total} exceeds model.max_seq_len={cfg.max_seq_len}, the learned position "
            f"table; expected max_new_tokens <= {cfg.max_seq_len - prompt_len}")
    if max_len is None:
        return total
    if prompt_len >= max_len or total > max_len:
        raise ValueError(
            f"max_len: the cache holds {max_len} positions, but the longest prompt has "
            f"{prompt_len} tokens and max_new_tokens={max_new_tokens} needs {total}")
    return max_len


def _check_chunk_size(chunk_size) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size: expected an int >= 1, got {chunk_size!r}")


def prefill(model: nnx.Module, prompts, cache: KVCache, *, chunk_size: int = 512,
            decode_implementation: str | None = None):
    """Runs right-padded ``prompts`` (as ``generate``'s ``prompt_tokens``) through the model
    into an empty ``cache``, chunk by chunk. Returns (float32 logits [B, vocab] at each
    prompt's last token, the cache)."""
    _check_chunk_size(chunk_size)
    return _prefill(model, split_flat(model), _as_prompts(prompts, model.cfg.vocab_size), cache,
                    chunk_size, decode_implementation)


def _prefill(model, flat, prompts: list[np.ndarray], cache: KVCache, chunk_size: int,
             decode_implementation: str | None):
    """``prefill`` of checked prompts (int32 1-D arrays of ids in the vocabulary), with the
    model's ``split_flat`` (structure, arrays) as ``flat``."""
    lengths = np.array([len(p) for p in prompts], np.int32)
    longest = int(lengths.max())
    C = min(chunk_size, longest)
    n_chunks = -(-longest // C)
    tokens_BxT = np.zeros((len(prompts), n_chunks * C), np.int32)
    for b, p in enumerate(prompts):
        tokens_BxT[b, :len(p)] = p
    structure, arrays = flat
    lengths_B = jnp.asarray(lengths)
    logits_BxV = jnp.zeros((len(prompts), model.cfg.vocab_size), jnp.float32)
    for c in range(n_chunks):
        fn = prefill_chunk_fn(structure, fresh=c == 0,
                              decode_implementation=decode_implementation)
        logits_BxV, cache = fn(arrays, jnp.asarray(tokens_BxT[:, c * C:(c + 1) * C]), cache,
                               jnp.int32(c * C), lengths_B, logits_BxV)
    return logits_BxV, cache


def generate(model: nnx.Module, prompt_tokens, *, max_new_tokens: int,
             temperature: float = 0.0, top_k: int | None = None, top_p: float | None = None,
             seed: int = 0, end_id: int | None = None, chunk_size: int = 512,
             max_len: int | None = None, cache_dtype=jnp.bfloat16,
             decode_implementation: str | None = None) -> GenerationResult:
    """Generates up to ``max_new_tokens`` tokens after each prompt (see the module docstring).

    prompt_tokens: one sequence of token ids, or a list of them (lengths may differ), or an
      int array [B, T].
    temperature: 0 for greedy decoding, else the softmax temperature; top_k / top_p restrict
      the sampled set; seed makes sampling reproducible.
    end_id: a row stops at this token (excluded from its result); None: never.
    chunk_size: prefill chunk length.
    max_len: cache positions (default: longest prompt + max_new_tokens).
    cache_dtype: dtype of the cached keys and values (bfloat16; float32 for exactness).
    decode_implementation: ``kernels.decode.cached_attention`` backend (None: "xla").
    """
    cfg = model.cfg
    prompts = _as_prompts(prompt_tokens, cfg.vocab_size)
    if not (isinstance(temperature, (int, float)) and not isinstance(temperature, bool)
            and np.isfinite(temperature) and temperature >= 0):
        raise ValueError(f"temperature: expected a float >= 0, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k: expected None or an int >= 1, got {top_k!r}")
    if top_p is not None and not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p: expected None or a float in (0, 1], got {top_p!r}")
    if end_id is not None and not (isinstance(end_id, int) and 0 <= end_id < cfg.vocab_size):
        raise ValueError(f"end_id: expected None or an id in [0, {cfg.vocab_size}), got {end_id!r}")
    _check_chunk_size(chunk_size)
    longest = max(len(p) for p in prompts)
    max_len = check_lengths(cfg, longest, max_new_tokens, max_len)

    t0 = time.perf_counter()
    cache = model.init_cache(len(prompts), max_len, dtype=cache_dtype)
    structure, arrays = flat = split_flat(model)
    logits_BxV, cache = _prefill(model, flat, prompts, cache, chunk_size, decode_implementation)
    jax.block_until_ready(logits_BxV)
    t1 = time.perf_counter()
    loop = decode_loop_fn(structure, max_new_tokens=max_new_tokens, temperature=float(temperature),
                          top_k=top_k, top_p=None if top_p is None else float(top_p),
                          end_id=end_id, decode_implementation=decode_implementation)
    rng = jax.random.key(seed)
    compiled = loop.lower(arrays, logits_BxV, cache, rng).compile()
    t2 = time.perf_counter()
    tokens_BxN, steps, _ = compiled(arrays, logits_BxV, cache, rng)
    tokens_BxN = np.asarray(jax.device_get(tokens_BxN))
    t3 = time.perf_counter()
    out = []
    for row in tokens_BxN[:, :int(steps)]:
        if end_id is not None and (row == end_id).any():
            row = row[:int(np.argmax(row == end_id))]
        out.append(row.astype(np.int32))
    return GenerationResult(tokens=out, prompt_lengths=[len(p) for p in prompts],
                            prefill_seconds=t1 - t0, compile_seconds=t2 - t1,
                            decode_seconds=t3 - t2, steps=int(steps))
