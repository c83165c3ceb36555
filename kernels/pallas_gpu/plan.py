"""The static plan of a Pallas GPU attention call: padded geometry, windows, launches.

A frozen ``AttentionPlan`` holds everything static about one call; ``make_plan`` builds it
from the case and the launches ``heuristics.launches`` decides (or given ones, for tests and
benchmarks). ``program_order`` gives a Triton kernel's programs, longest first, so long
global-head programs do not straggle behind a tail of short local ones.
"""

from __future__ import annotations

import dataclasses
import functools
import os

import jax.numpy as jnp
import numpy as np

from ls_jax.kernels.band import WindowSizes, cdiv, is_global, kv_block_range, q_block_range
from ls_jax.kernels.pallas_gpu import heuristics
from ls_jax.kernels.pallas_gpu.common import triton_block
from ls_jax.kernels.pallas_gpu.configs import Launches, StripConfig, TritonConfig


@dataclasses.dataclass(frozen=True)
class AttentionPlan:
    """Everything static about one call (hashable: the ``jax.custom_vjp`` static argument).

    Sequences are padded to ``seq_len_padded`` (a multiple of every block of the launches)
    and the head dimension to ``head_dim_padded`` (a power of two >= 16) with zeros; padding
    keys are never visible to real queries, padding queries are sliced away.
    windows: each query head's effective window over the padded length (a global head's is
    the padded length).
    """

    seq_len: int
    seq_len_padded: int
    head_dim: int
    head_dim_padded: int
    windows: tuple[int, ...]
    num_kv_heads: int
    scale: float
    launches: Launches
    logit_stats: bool
    interpret: bool


def padded_head_dim(head_dim: int) -> int:
    """The head size the kernels compute with: a power of two >= 16."""
    return triton_block(head_dim)


def interpreter_consumers(consumers: int) -> int:
    """``consumers``, or 2 where Pallas' GPU interpreter cannot run ``consumers + 1``
    warpgroups at once: it runs each as a CPU execution that blocks at barriers, one more at
    once than it counts processors (``PJRT_NPROC``, default the machine's). The results are
    the same."""
    processors = int(os.environ.get("PJRT_NPROC") or os.cpu_count() or 1)
    return consumers if consumers <= processors else 2


def fit_launches(launches: Launches, seq_len: int, interpret: bool) -> Launches:
    """``launches`` with every Triton tile at most the sequence (rounded up to a power of
    two), so that a short call is not padded to a long tile; in interpret mode, with as many
    Mosaic consumers as the interpreter runs here."""
    def fit(launch):
        config = launch.config
        if isinstance(config, TritonConfig):
            config = config.fit_to(seq_len)
        elif interpret and hasattr(config, "consumers"):
            config = dataclasses.replace(config,
                                         consumers=interpreter_consumers(config.consumers))
        return dataclasses.replace(launch, config=config)
    return dataclasses.replace(launches, forward=tuple(map(fit, launches.forward)),
                               backward=tuple(map(fit, launches.backward)))


def make_plan(*, seq_len: int, head_dim: int, windows: WindowSizes, num_kv_heads: int,
              dtype, scale: float, logit_stats: bool, interpret: bool, batch: int,
              has_segments: bool, launches: Launches | None = None) -> AttentionPlan:
    """The call's plan: ``launches`` (default: ``heuristics.launches`` for this case on this
    GPU) fitted to the sequence, and the padding they need."""
    head_dim_padded = padded_head_dim(head_dim)
    case = heuristics.Case(dtype=dtype, head_dim=head_dim_padded, windows=tuple(windows),
                           seq_len=seq_len, batch=batch, num_kv_heads=num_kv_heads,
                           has_segments=has_segments, gpu=heuristics.current_gpu(interpret),
                           interpret=interpret)
    if launches is None:
        launches = heuristics.launches(case)
    elif (launches.num_heads, launches.num_kv_heads) != (len(windows), num_kv_heads):
        raise ValueError(f"launches: expected launches for {len(windows)} query heads and "
                         f"{num_kv_heads} kv heads, got {launches.num_heads} and "
                         f"{launches.num_kv_heads}")
    elif not heuristics.mosaic_takes(case) and any(
            launch.lowering != "triton" for launch in launches.forward + launches.backward):
        raise ValueError(
            f"launches: the Mosaic GPU lowerings take 16-bit inputs, a head size that pads to "
            f"64 or 128 and no segment ids; got {jnp.dtype(dtype).name}, head size {head_dim}"
            f"{', segment ids' if has_segments else ''}: use 'triton' launches")
    else:
        for launch in launches.forward:
            one_pass = isinstance(launch.config, StripConfig) and launch.config.one_pass
            if one_pass and len({windows[h] for h in launch.heads}) > 1:
                raise ValueError(
                    f"launches: a strip launch with one_pass=True takes heads of one window; "
                    f"got windows {[windows[h] for h in launch.heads]} for heads "
                    f"{list(launch.heads)}")
    launches = fit_launches(launches, seq_len, interpret)
    block = max(launches.blocks())
    seq_len_padded = cdiv(seq_len, block) * block
    return AttentionPlan(
        seq_len=seq_len, seq_len_padded=seq_len_padded, head_dim=head_dim,
        head_dim_padded=head_dim_padded,
        windows=tuple(seq_len_padded if is_global(w, seq_len) else w for w in windows),
        num_kv_heads=num_kv_heads, scale=float(scale), launches=launches,
        logit_stats=bool(logit_stats), interpret=bool(interpret))


@functools.lru_cache(maxsize=256)
def program_order(head_windows: tuple[tuple[int, ...], ...], heads: tuple[int, ...],
                  seq_len: int, block_q: int, block_k: int, per_key_block: bool) -> np.ndarray:
    """int32 [n]: the programs of a Triton kernel over ``heads``, most work first.

    A program is ``head * num_slots + block`` with ``num_slots = seq_len // block`` (query
    blocks of ``block_q`` for the forward and dQ; key blocks of ``block_k`` for dK/dV, whose
    "heads" are kv heads). head_windows[h]: the windows of the query heads of head h (one for
    the forward and dQ, a GQA group's for dK/dV).
    """
    block = block_k if per_key_block else block_q
    block_range = q_block_range if per_key_block else kv_block_range
    num_slots = seq_len // block
    items, costs = [], []
    for h in heads:
        for i in range(num_slots):
            visits = sum(np.subtract(*block_range(i, block_q, block_k, w, seq_len)[::-1])
                         for w in head_windows[h])
            items.append(h * num_slots + i)
            costs.append(int(visits))
    order = np.argsort(-np.asarray(costs), kind="stable")
    return np.asarray(items, np.int32)[order]
