"""The launches of a Pallas GPU attention call, as small frozen configs validated at construction.

A call runs one or more *launches* per pass (forward; backward), each computing a set of query
heads with one lowering: "triton" (``triton/``, any CUDA GPU), "hopper" (``mosaic/forward.py``
and ``mosaic/backward.py``, Hopper) or "strip" (the local heads as strips on Hopper:
``mosaic/strip.py`` forward, ``mosaic/strip_backward.py`` backward). ``heuristics.py``
decides them; ``backend.py`` executes them in order, each later launch writing its heads into
the buffers of the earlier ones.
"""

from __future__ import annotations

import dataclasses

from ls_jax.kernels.pallas_gpu.common import triton_block

LOWERINGS = ("triton", "hopper", "strip")


def _check_power_of_two(owner: str, name: str, value, minimum: int):
    if not (type(value) is int and value >= minimum and not value & (value - 1)):
        raise ValueError(f"{owner}.{name}: expected a power of two >= {minimum}, got {value!r}")


def _check_count(owner: str, name: str, value):
    if not (type(value) is int and value >= 1):
        raise ValueError(f"{owner}.{name}: expected an int >= 1, got {value!r}")


def _check_choice(owner: str, name: str, value, choices):
    if not any(type(value) is type(c) and value == c for c in choices):
        raise ValueError(f"{owner}.{name}: expected one of {tuple(choices)}, got {value!r}")


@dataclasses.dataclass(frozen=True)
class TritonConfig:
    """Tiles and launch parameters of the three Triton kernels (forward, dQ, dK/dV).

    split_loop: the forward runs the tiles fully inside the band in a loop of their own, with
    the element mask compiled only into the boundary loops (else one loop, the mask behind a
    run-time branch). Calls with segment ids mask every tile whatever this says.
    """

    block_q: int = 64
    block_k: int = 64
    dq_block_q: int = 64
    dq_block_k: int = 32
    dkdv_block_q: int = 32
    dkdv_block_k: int = 64
    num_warps: int = 4
    num_stages: int = 3
    split_loop: bool = False

    def __post_init__(self):
        for name in ("block_q", "block_k", "dq_block_q", "dq_block_k", "dkdv_block_q",
                     "dkdv_block_k"):
            _check_power_of_two("TritonConfig", name, getattr(self, name), 16)
        _check_choice("TritonConfig", "num_warps", self.num_warps, (4, 8))
        _check_choice("TritonConfig", "num_stages", self.num_stages, (1, 2, 3, 4))
        _check_choice("TritonConfig", "split_loop", self.split_loop, (False, True))

    def blocks(self) -> tuple[int, ...]:
        return (self.block_q, self.block_k, self.dq_block_q, self.dq_block_k,
                self.dkdv_block_q, self.dkdv_block_k)

    def fit_to(self, seq_len: int) -> "TritonConfig":
        """Every block at most the sequence rounded up to a power of two (>= 16)."""
        cap = triton_block(seq_len)
        names = ("block_q", "block_k", "dq_block_q", "dq_block_k", "dkdv_block_q",
                 "dkdv_block_k")
        return dataclasses.replace(self, **{n: min(getattr(self, n), cap) for n in names})


@dataclasses.dataclass(frozen=True)
class HopperForwardConfig:
    """The Hopper forward: ``consumers`` warpgroups of ``block_q`` query rows each (a tile is
    ``consumers * block_q`` rows) fed ``block_k``-key blocks by one producer warpgroup."""

    block_q: int = 64
    block_k: int = 128
    consumers: int = 2

    def __post_init__(self):
        _check_power_of_two("HopperForwardConfig", "block_q", self.block_q, 64)
        _check_power_of_two("HopperForwardConfig", "block_k", self.block_k, 64)
        _check_choice("HopperForwardConfig", "consumers", self.consumers, (2, 3))

    def blocks(self) -> tuple[int, ...]:
        # two consumers need whole tiles; three take a ragged last tile
        return (2 * self.block_q, self.block_k)


@dataclasses.dataclass(frozen=True)
class HopperBackwardConfig:
    """The Hopper dQ and dK/dV kernels: each of ``consumers`` warpgroups owns one block of its
    side (``block_q`` query rows in dQ, ``block_k`` keys in dK/dV) and a producer streams the
    other side (``dq_block_k`` keys in dQ, ``block_q`` query rows in dK/dV).

    dq_delta: the dQ kernel computes ``delta = rowsum(O * dO)`` from its own tiles (else one
    XLA pass before it); ``heuristics.hopper_backward`` sets it where O's tile fits shared
    memory.
    """

    block_q: int = 64
    block_k: int = 64
    dq_block_k: int = 64
    consumers: int = 2
    dq_delta: bool = True

    def __post_init__(self):
        for name in ("block_q", "block_k", "dq_block_k"):
            _check_power_of_two("HopperBackwardConfig", name, getattr(self, name), 64)
        _check_choice("HopperBackwardConfig", "consumers", self.consumers, (2, 3))
        _check_choice("HopperBackwardConfig", "dq_delta", self.dq_delta, (False, True))

    def blocks(self) -> tuple[int, ...]:
        return (2 * self.block_q, 2 * self.block_k, self.dq_block_k)


STRIP_BLOCK = 64  # the strip forward's query and key blocks: one wgmma row block


@dataclasses.dataclass(frozen=True)
class StripConfig:
    """The strip forward of local heads: each program walks ``strip_blocks`` consecutive
    ``STRIP_BLOCK``-row query blocks of one head with ``consumers`` warpgroups, the keys and
    values of their bands streamed once through one ring. ``one_pass``: the heads share one
    window, and a query block's band, past the sequence's first blocks, is softmaxed in one
    pass (its key blocks' scores together, masks with static bounds)."""

    strip_blocks: int = 64
    consumers: int = 3
    one_pass: bool = False

    def __post_init__(self):
        _check_count("StripConfig", "strip_blocks", self.strip_blocks)
        _check_choice("StripConfig", "consumers", self.consumers, (2, 3))
        _check_choice("StripConfig", "one_pass", self.one_pass, (False, True))

    def blocks(self) -> tuple[int, ...]:
        return (STRIP_BLOCK,)


@dataclasses.dataclass(frozen=True)
class StripBackwardConfig:
    """The fused strip backward of local heads: each consumer walks ``sub_blocks`` consecutive
    ``STRIP_BLOCK``-key blocks of one head (after a warm-up over the key blocks before them
    that reach its first query block), the query side of their bands streamed once; with
    ``kv_slots=2`` the next key block's K and V load while the current one is computed. The
    forward's O tiles (for delta) load ``o_slots`` query blocks ahead into tiles of their own,
    or with ``o_slots=0`` into the dQ tiles, each once its last share is out."""

    sub_blocks: int = 32
    kv_slots: int = 2
    o_slots: int = 0

    def __post_init__(self):
        _check_count("StripBackwardConfig", "sub_blocks", self.sub_blocks)
        _check_choice("StripBackwardConfig", "kv_slots", self.kv_slots, (1, 2))
        _check_choice("StripBackwardConfig", "o_slots", self.o_slots, (0, 1, 2))

    def blocks(self) -> tuple[int, ...]:
        return (STRIP_BLOCK,)


@dataclasses.dataclass(frozen=True)
class Launch:
    """One kernel launch of a pass: ``lowering`` over the query ``heads`` (sorted, distinct).

    config: a TritonConfig for "triton", a HopperForwardConfig (forward) or
    HopperBackwardConfig (backward) for "hopper", a StripConfig (forward) or
    StripBackwardConfig (backward) for "strip".
    """

    lowering: str
    heads: tuple[int, ...]
    config: (TritonConfig | HopperForwardConfig | HopperBackwardConfig | StripConfig
             | StripBackwardConfig)

    def __post_init__(self):
        _check_choice("Launch", "lowering", self.lowering, LOWERINGS)
        heads = tuple(self.heads)
        if not heads or list(heads) != sorted(set(heads)) or min(heads) < 0:
            raise ValueError(f"Launch.heads: expected distinct head indices in increasing "
                             f"order, got {self.heads!r}")
        object.__setattr__(self, "heads", heads)
        want = {"triton": (TritonConfig,),
                "hopper": (HopperForwardConfig, HopperBackwardConfig),
                "strip": (StripConfig, StripBackwardConfig)}[self.lowering]
        if not isinstance(self.config, want):
            raise ValueError(f"Launch.config: expected {' or '.join(t.__name__ for t in want)} "
                             f"for lowering {self.lowering!r}, got {self.config!r}")

    def blocks(self) -> tuple[int, ...]:
        return self.config.blocks()


@dataclasses.dataclass(frozen=True)
class Launches:
    """The launches of a call's forward and of its backward, in execution order.

    Checked at construction: each pass covers every one of ``num_heads`` query heads exactly
    once; each launch's config is its pass's (a strip launch takes a ``StripConfig`` in the
    forward, a ``StripBackwardConfig`` in the backward); a Hopper launch first (it writes
    fresh buffers, the others write into them); a backward split over several launches, or
    a strip backward, only with one kv head per query head (dK/dV sums each GQA group in one
    kernel; the strip backward computes one query head's dK/dV per program).
    """

    forward: tuple[Launch, ...]
    backward: tuple[Launch, ...]
    num_heads: int
    num_kv_heads: int

    def __post_init__(self):
        for name in ("forward", "backward"):
            launches = tuple(getattr(self, name))
            object.__setattr__(self, name, launches)
            covered = sorted(h for launch in launches for h in launch.heads)
            if covered != list(range(self.num_heads)):
                raise ValueError(f"Launches.{name}: expected every head of {self.num_heads} "
                                 f"exactly once, got {[l.heads for l in launches]}")
            for i, launch in enumerate(launches):
                if launch.lowering == "hopper" and i > 0:
                    raise ValueError(f"Launches.{name}: a hopper launch must come first, got "
                                     f"{[l.lowering for l in launches]}")
                config = launch.config
                backward = name == "backward"
                if launch.lowering == "hopper" and isinstance(
                        config, HopperBackwardConfig) != backward:
                    raise ValueError(f"Launches.{name}: expected a Hopper"
                                     f"{'Backward' if backward else 'Forward'}Config, "
                                     f"got {config!r}")
                if launch.lowering == "strip" and isinstance(
                        config, StripBackwardConfig) != backward:
                    raise ValueError(f"Launches.{name}: expected a "
                                     f"{'StripBackwardConfig' if backward else 'StripConfig'}, "
                                     f"got {config!r}")
        if (any(launch.lowering == "strip" for launch in self.backward)
                and self.num_kv_heads != self.num_heads):
            raise ValueError(f"Launches.backward: the strip lowering needs one kv head per "
                             f"query head, got {self.num_kv_heads} kv heads for "
                             f"{self.num_heads}")
        if len(self.backward) > 1 and self.num_kv_heads != self.num_heads:
            raise ValueError(f"Launches.backward: several launches need one kv head per query "
                             f"head, got {self.num_kv_heads} kv heads for {self.num_heads}")

    def blocks(self) -> tuple[int, ...]:
        return tuple(b for launch in self.forward + self.backward for b in launch.blocks())
