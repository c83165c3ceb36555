"""The Pallas GPU kernels against the pure-JAX reference twin, every lowering on the CPU.

Each kernel path runs here in interpret mode (the Triton kernels in Pallas' interpreter, the
Mosaic GPU kernels in Pallas' GPU interpreter, which runs each warpgroup as a thread and checks
barriers and TMA) on tiny shapes, with explicit launches (``configs.Launches``: small tiles,
subsets of heads, every consumer count) and with the default ones, against
``kernels.reference``: outputs, lse, logit statistics and gradients. The Mosaic kernels' GPU
code paths that the interpreter does not run are lowered for the GPU on the CPU. The block
ranges the kernels visit are checked against brute force. GPU-only tests (marked ``gpu``) run
the compiled kernels in 16-bit at realistic sizes.
"""

from __future__ import annotations

import collections
import dataclasses
import re
import warnings
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from ls_jax.kernels import ls_attention
from ls_jax.kernels.band import (band_blocks, kv_block_range, kv_full_block_range,
                                 q_block_range, q_full_block_range)
from ls_jax.kernels.pallas_gpu import (HopperBackwardConfig, HopperForwardConfig, Launch,
                                       Launches, StripBackwardConfig, StripConfig,
                                       TritonConfig, heuristics, pallas_gpu_attention,
                                       pallas_gpu_attention_parts)
from ls_jax.kernels.pallas_gpu.common import split_kv_loop, split_q_loop
from ls_jax.kernels.pallas_gpu.mosaic import backward as mosaic_backward
from ls_jax.kernels.pallas_gpu.plan import interpreter_consumers, make_plan, program_order

from jitted_reference import reference_attention_parts, reference_vjp  # tests/, beside this file

pytestmark = pytest.mark.filterwarnings("ignore:.*Pallas Triton backend is deprecated")


def rel_err(got, want):
    got = np.asarray(got, np.float64)
    want = np.asarray(want, np.float64)
    assert np.all(np.isfinite(got)), "non-finite values in the result"
    return float(np.linalg.norm(got - want) / np.linalg.norm(want))


@dataclasses.dataclass(frozen=True)
class Shape:
    """One call's shapes: q [B, T, H, D], k and v [B, T, G, D], a window per query head."""

    B: int
    T: int
    H: int
    G: int
    D: int
    windows: tuple
    dtype: object = jnp.float32
    segments: bool = False

    def name(self) -> str:
        w = "_".join(map(str, self.windows))
        return (f"{jnp.dtype(self.dtype).name}-B{self.B}-T{self.T}-H{self.H}/{self.G}-D{self.D}"
                f"-w{w}{'-seg' if self.segments else ''}")

    def inputs(self):
        """q, k, v, dO and the segment ids (or None), from a seed of the shape's own."""
        rng = np.random.default_rng(zlib.crc32(self.name().encode()))
        B, T, H, G, D = self.B, self.T, self.H, self.G, self.D
        q, k, v, do = (jnp.asarray(rng.standard_normal(s, np.float32), self.dtype)
                       for s in [(B, T, H, D), (B, T, G, D), (B, T, G, D), (B, T, H, D)])
        seg = (jnp.asarray(np.sort(rng.integers(0, 4, (B, T)), axis=1), jnp.int32)
               if self.segments else None)
        return q, k, v, do, seg


# 16-bit inputs, float32 scores: the rounding of the output and of the gradients' 16-bit
# products sets these; lse and the statistics come from float32 scores of the same inputs
TOLERANCES = {  # dtype: (out, gradients, lse and max |logit|)
    jnp.dtype(jnp.float32): (1e-5, 1e-5, 1e-5),
    jnp.dtype(jnp.bfloat16): (1e-2, 2e-2, 1e-5),
}


def check_forward(shape: Shape, launches: Launches | None):
    """out, lse and max |logit| of ``pallas_gpu_attention_parts`` against the reference."""
    q, k, v, _, seg = shape.inputs()
    out, lse, stats = jax.jit(lambda q, k, v: pallas_gpu_attention_parts(
        q, k, v, shape.windows, segment_ids=seg, launches=launches, interpret=True))(q, k, v)
    f32 = [np.asarray(x, np.float32) for x in (q, k, v)]
    want_out, want_lse, want_stats = reference_attention_parts(*f32, shape.windows, seg)
    tol, _, tol_lse = TOLERANCES[jnp.dtype(shape.dtype)]
    assert out.dtype == q.dtype and out.shape == q.shape
    assert lse.shape == (shape.B, shape.H, shape.T) and stats.shape == (shape.H,)
    out, want_out = np.asarray(out, np.float64), np.asarray(want_out, np.float64)
    for h in range(shape.H):  # a head written by no launch, or by the wrong one, fails here
        assert rel_err(out[:, :, h], want_out[:, :, h]) < tol, ("out", h)
    assert rel_err(lse, want_lse) < tol_lse, "lse"
    np.testing.assert_allclose(stats, want_stats, rtol=tol_lse, err_msg="max |logit|")


def check_gradients(shape: Shape, launches: Launches | None, *, scale=None, public=False):
    """out, max |logit| and (dq, dk, dv) of one differentiated call against the reference's;
    ``public``: through ``ls_attention`` (which takes the default launches)."""
    q, k, v, do, seg = shape.inputs()

    def ours(q, k, v):
        if public:
            out, stats = ls_attention(q, k, v, shape.windows, segment_ids=seg, scale=scale,
                                      implementation="pallas_gpu", interpret=True,
                                      return_logit_stats=True)
            return out, stats.max_abs_logit
        return pallas_gpu_attention(q, k, v, shape.windows, segment_ids=seg, scale=scale,
                                    return_logit_stats=True, launches=launches, interpret=True)

    @jax.jit
    def run(q, k, v, do):
        (out, stats), vjp = jax.vjp(ours, q, k, v)
        return out, stats, vjp((do, jnp.zeros_like(stats)))

    out, stats, grads = run(q, k, v, do)
    want_out, want_stats, want_grads = reference_vjp(q, k, v, do, shape.windows, seg, scale)
    tol, tol_grad, tol_stats = TOLERANCES[jnp.dtype(shape.dtype)]
    assert rel_err(out, want_out) < tol, "out"
    np.testing.assert_allclose(stats, want_stats, rtol=tol_stats, err_msg="max |logit|")
    for name, g, w, x in zip(("dq", "dk", "dv"), grads, want_grads, (q, k, v)):
        assert g.shape == x.shape and g.dtype == x.dtype, name
        assert rel_err(g, w) < tol_grad, name


def launches(H: int, G: int, forward, backward) -> Launches:
    """Launches from (lowering, heads, config) triples; heads None means every head."""
    def make(items):
        return tuple(Launch(lowering, tuple(range(H)) if heads is None else heads, config)
                     for lowering, heads, config in items)
    return Launches(forward=make(forward), backward=make(backward), num_heads=H,
                    num_kv_heads=G)


def triton(H: int, G: int, config: TritonConfig) -> Launches:
    return launches(H, G, [("triton", None, config)], [("triton", None, config)])


# ---------------------------------------------------------------------------------------------
# The Triton kernels (forward, dQ, dK/dV), float32 and bfloat16

SMALL = TritonConfig(block_q=32, block_k=16, dq_block_q=16, dq_block_k=32, dkdv_block_q=16,
                     dkdv_block_k=32)
SQUARE16 = TritonConfig(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkdv_block_q=16,
                        dkdv_block_k=16, split_loop=True)
WIDE32 = TritonConfig(block_q=32, block_k=32, dq_block_q=32, dq_block_k=32, dkdv_block_q=32,
                      dkdv_block_k=32, split_loop=True)

# T is never a multiple of the largest block
TRITON_CASES = [
    pytest.param(Shape(2, 77, 4, 4, 32, (None, 5, 1, 40)), triton(4, 4, SMALL),
                 id="mixed-p1-one-loop"),
    pytest.param(Shape(1, 100, 6, 2, 16, (3, None, 100, 17, 1, 250)), triton(6, 2, SQUARE16),
                 id="gqa-windows-at-and-past-T-split-loop"),
    pytest.param(Shape(2, 45, 2, 1, 32, (None, None)), triton(2, 1, SQUARE16),
                 id="all-global-mqa"),
    pytest.param(Shape(1, 130, 4, 2, 64, (16, 33, 2, 64)), triton(4, 2, WIDE32),
                 id="all-local-windows-at-block-edges"),
    pytest.param(Shape(1, 40, 3, 3, 24, (7, None, 1)), triton(3, 3, SMALL),
                 id="head-size-24-padded"),
    pytest.param(Shape(1, 96, 4, 2, 64, (None, 20, 1, 64), jnp.bfloat16), triton(4, 2, WIDE32),
                 id="bf16-gqa"),
    # the heads split over two launches of different tiles, the second writing into the
    # first's buffers in both passes
    pytest.param(Shape(1, 150, 4, 4, 16, (None, 5, 1, 40)),
                 launches(4, 4, [("triton", (0, 3), WIDE32), ("triton", (1, 2), SMALL)],
                          [("triton", (1, 2), SMALL), ("triton", (0, 3), WIDE32)]),
                 id="two-launches"),
    # segment ids mask every tile whatever split_loop says
    pytest.param(Shape(2, 70, 4, 2, 32, (None, 6, 1, 3), segments=True), triton(4, 2, SMALL),
                 id="segments-gqa"),
    pytest.param(Shape(2, 70, 4, 4, 32, (None, 6, 1, 3), segments=True),
                 launches(4, 4, [("triton", (0,), WIDE32), ("triton", (1, 2, 3), SQUARE16)],
                          [("triton", (0, 1), SQUARE16), ("triton", (2, 3), SMALL)]),
                 id="segments-two-launches-split-loop"),
]


@pytest.mark.parametrize("shape,launch", [c for c in TRITON_CASES if c.id in (
    "mixed-p1-one-loop", "head-size-24-padded", "bf16-gqa", "segments-gqa")])
def test_triton_forward_matches_reference(shape, launch):
    """out, lse and max |logit| (the gradient tests check out and max |logit| of every case;
    the backward reads lse, so a wrong one fails them too)."""
    check_forward(shape, launch)


@pytest.mark.parametrize("shape,launch", [c for c in TRITON_CASES
                                          if c.id != "head-size-24-padded"])
def test_triton_gradients_match_reference(shape, launch):
    check_gradients(shape, launch)


# ---------------------------------------------------------------------------------------------
# The Mosaic GPU kernels in Pallas' GPU interpreter, bfloat16, D=64

TRITON16 = TritonConfig(block_q=16, block_k=16, dq_block_q=16, dq_block_k=16, dkdv_block_q=16,
                        dkdv_block_k=16)
FWD2 = HopperForwardConfig(block_q=64, block_k=64, consumers=2)
FWD3 = HopperForwardConfig(block_q=64, block_k=64, consumers=3)
BWD2 = HopperBackwardConfig(block_q=64, block_k=64, dq_block_k=64, consumers=2, dq_delta=True)


def bf16(B, T, H, G, windows) -> Shape:
    return Shape(B, T, H, G, 64, windows, jnp.bfloat16)


HOPPER_FORWARD_CASES = [
    # padded T (4 blocks), GQA, p = 1, p = one block, p past two blocks
    pytest.param(bf16(1, 200, 4, 2, (None, 1, 64, 130)),
                 launches(4, 2, [("hopper", None, FWD2)], [("triton", None, TRITON16)]),
                 id="every-head-2-consumers"),
    # 4 query blocks in tiles of 3: the last tile's extra consumers redo block 3
    pytest.param(bf16(1, 256, 2, 1, (None, 50)),
                 launches(2, 1, [("hopper", None, FWD3)], [("triton", None, TRITON16)]),
                 id="every-head-3-consumers-ragged-tile"),
    # 128-key blocks; the local heads' rows then written by the Triton forward
    pytest.param(bf16(2, 160, 4, 2, (5, None, 64, None)),
                 launches(4, 2, [("hopper", (1, 3), HopperForwardConfig(block_k=128)),
                                 ("triton", (0, 2), TRITON16)], [("triton", None, TRITON16)]),
                 id="global-heads-then-triton"),
    # ... or by the strip forward: padded T (8 blocks: strips of 3, 3, 2), MQA
    pytest.param(bf16(1, 400, 5, 1, (None, 1, 64, 255, 100)),
                 launches(5, 1, [("hopper", (0,), FWD3),
                                 ("strip", (1, 2, 3, 4), StripConfig(strip_blocks=3))],
                          [("triton", None, TRITON16)]),
                 id="global-heads-then-strips"),
]


@pytest.mark.parametrize("shape,launch", HOPPER_FORWARD_CASES)
def test_hopper_forward_matches_reference(shape, launch):
    check_forward(shape, launch)


def strips(H, G, heads, config, first=()) -> Launches:
    return launches(H, G, list(first) + [("strip", heads, config)],
                    [("triton", None, TRITON16)])


STRIP_CASES = [
    # every head local, no earlier launch: strips of 2 of 4 blocks, two batch elements
    pytest.param(bf16(2, 256, 2, 2, (50, 128)),
                 strips(2, 2, None, StripConfig(strip_blocks=2, consumers=2)),
                 id="every-head-local-2-consumers"),
    # windows from 1 to 256 (the widest whose ring fits): strips of one block
    pytest.param(bf16(1, 320, 4, 4, (1, 65, 192, 256)),
                 strips(4, 4, None, StripConfig(strip_blocks=1)), id="windows-1-to-256", marks=pytest.mark.slow),
    # a strip longer than the sequence, GQA
    pytest.param(bf16(1, 192, 2, 1, (100, 7)), strips(2, 1, None, StripConfig(strip_blocks=8)),
                 id="one-strip-a-row-gqa"),
    # one window, its band in one pass past the first blocks (3 key blocks: edge and diagonal
    # masked; 2 blocks, both masked; the diagonal alone), strips of 4, 3 and 2 blocks
    pytest.param(bf16(1, 640, 2, 2, (128, 128)),
                 strips(2, 2, None, StripConfig(strip_blocks=4, one_pass=True)),
                 id="one-pass-three-blocks"),
    pytest.param(bf16(2, 384, 3, 3, (None, 65, 65)),
                 strips(3, 3, (1, 2), StripConfig(strip_blocks=3, one_pass=True),
                        first=[("triton", (0,), TRITON16)]),
                 id="one-pass-two-blocks-after-a-triton-launch"),
    pytest.param(bf16(1, 256, 2, 1, (1, 1)),
                 strips(2, 1, None, StripConfig(strip_blocks=2, one_pass=True)),
                 id="one-pass-diagonal-gqa"),
    # into the Triton forward's buffers (a global head first)
    pytest.param(bf16(1, 256, 3, 3, (None, 128, 20)),
                 strips(3, 3, (1, 2), StripConfig(strip_blocks=2),
                        first=[("triton", (0,), TRITON16)]),
                 id="after-a-triton-launch"),
]


@pytest.mark.parametrize("shape,launch", STRIP_CASES)
def test_strip_forward_matches_reference(shape, launch):
    check_forward(shape, launch)


HOPPER_BACKWARD_CASES = [
    pytest.param(bf16(1, 200, 3, 3, (None, 20, 64)),
                 launches(3, 3, [("hopper", None, FWD2)], [("hopper", None, BWD2)]),
                 id="delta-in-dq-kernel", marks=pytest.mark.slow),
    # GQA: each dK/dV program sums a group of a global and a local head
    pytest.param(bf16(1, 200, 4, 2, (None, 20, 130, 7)),
                 launches(4, 2, [("hopper", None, FWD2)],
                          [("hopper", None, dataclasses.replace(BWD2, dq_delta=False))]),
                 id="delta-by-xla-gqa-group-sums", marks=pytest.mark.slow),
    pytest.param(bf16(1, 200, 3, 1, (None, 20, 130)),
                 launches(3, 1, [("hopper", None, FWD3)],
                          [("hopper", None, dataclasses.replace(BWD2, consumers=3))]),
                 id="3-consumers-mqa", marks=pytest.mark.slow),
    pytest.param(bf16(1, 200, 3, 3, (20, 130, 1)),
                 launches(3, 3, [("hopper", None, HopperForwardConfig(block_k=128))],
                          [("hopper", None, dataclasses.replace(BWD2, block_q=128,
                                                                dq_block_k=128))]),
                 id="every-head-local-128-row-blocks"),
    # the global heads on the Hopper kernels, the local head's rows by the Triton ones
    pytest.param(bf16(1, 200, 3, 3, (None, 7, None)),
                 launches(3, 3, [("hopper", (0, 2), FWD2), ("triton", (1,), TRITON16)],
                          [("hopper", (0, 2), BWD2), ("triton", (1,), TRITON16)]),
                 id="global-heads-then-triton"),
]


@pytest.mark.parametrize("shape,launch", HOPPER_BACKWARD_CASES)
def test_hopper_backward_matches_reference(shape, launch):
    check_gradients(shape, launch)


def strip_backward(H, heads, config, first=()) -> Launches:
    return launches(H, H, [("triton", None, TRITON16)],
                    list(first) + [("strip", heads, config)])


STRIP_BACKWARD_CASES = [
    # 4 key blocks in sub-strips of 3 and 1 (a program's second consumer has one, its warm-up
    # reaching back into the first's), a window of one block and one past it
    pytest.param(bf16(1, 256, 2, 2, (64, 50)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=3)),
                 id="ragged-sub-strips"),
    # windows 1 to 65 (bands of one and two query blocks), padded T, two batch elements,
    # sub-strips of one block: every query block's dQ gathered across a warm-up
    pytest.param(bf16(2, 200, 4, 4, (1, 7, 64, 65)),
                 strip_backward(4, None, StripBackwardConfig(sub_blocks=1)),
                 id="windows-1-to-65-one-block-sub-strips"),
    # a band of three query blocks (two dQ tiles; in the interpreter, which has shared memory
    # for it), into the Hopper backward's buffers (a global head first)
    pytest.param(bf16(1, 320, 3, 3, (None, 128, 100)),
                 strip_backward(3, (1, 2), StripBackwardConfig(sub_blocks=2),
                                first=[("hopper", (0,), BWD2)]),
                 id="three-block-band-after-a-hopper-launch"),
    # heads of one window: each query block's offset from the key block picks a mask with
    # static bounds (bands of two and three query blocks, the middle one inside; window 2:
    # the second block's mask keeps one key a row)
    pytest.param(bf16(2, 130, 2, 2, (2, 2)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=1)),
                 id="one-window-of-two"),
    pytest.param(bf16(1, 256, 2, 2, (50, 50)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=3)),
                 id="one-window-two-block-band"),
    pytest.param(bf16(1, 320, 2, 2, (128, 128)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=2)),
                 id="one-window-three-block-band"),
    # one K/V slot: the next key block's V loads after the last dP^T, its K after the last dQ
    pytest.param(bf16(1, 320, 2, 2, (128, 128)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=2, kv_slots=1)),
                 id="one-kv-slot-one-window"),
    pytest.param(bf16(1, 320, 3, 3, (None, 128, 100)),
                 strip_backward(3, (1, 2), StripBackwardConfig(sub_blocks=3, kv_slots=1),
                                first=[("hopper", (0,), BWD2)]),
                 id="one-kv-slot-two-windows-after-a-hopper-launch"),
    # O tiles of their own, one or two query blocks ahead (above: in the dQ tiles)
    pytest.param(bf16(2, 200, 4, 4, (1, 7, 64, 65)),
                 strip_backward(4, None, StripBackwardConfig(sub_blocks=1, o_slots=2)),
                 id="own-o-tiles-windows-1-to-65"),
    pytest.param(bf16(1, 320, 3, 3, (None, 128, 100)),
                 strip_backward(3, (1, 2), StripBackwardConfig(sub_blocks=2, kv_slots=1,
                                                               o_slots=1),
                                first=[("hopper", (0,), BWD2)]),
                 id="one-own-o-tile-two-windows-after-a-hopper-launch"),
    # three sub-strips a row: the consumers take the rows' sub-strips in turn, so a program
    # holds two rows (other windows) and the last consumer has none
    pytest.param(bf16(1, 384, 3, 3, (64, 50, 7)),
                 strip_backward(3, None, StripBackwardConfig(sub_blocks=2)),
                 id="odd-sub-strips-a-row-consumers-across-rows"),
    # a sub-strip longer than the sequence: a program's two consumers on two rows
    pytest.param(bf16(1, 192, 2, 2, (100, 3)),
                 strip_backward(2, None, StripBackwardConfig(sub_blocks=8)),
                 id="one-sub-strip-a-row", marks=pytest.mark.slow),
]


@pytest.mark.parametrize("shape,launch", STRIP_BACKWARD_CASES)
def test_strip_backward_matches_reference(shape, launch):
    check_gradients(shape, launch)


# ---------------------------------------------------------------------------------------------
# The default launches (interpret mode plans for a Hopper GPU: heuristics.current_gpu)

DEFAULT_CASES = [
    pytest.param(bf16(1, 200, 4, 2, (None, 20, 1, None)), id="bf16-mix"),
    pytest.param(bf16(1, 130, 2, 2, (None, None)), id="bf16-all-global",
                 marks=pytest.mark.slow),
    # the public entry point's case below, through pallas_gpu_attention_parts
    pytest.param(Shape(1, 50, 2, 1, 16, (None, 9)), id="fp32", marks=pytest.mark.slow),
    pytest.param(Shape(1, 64, 2, 2, 64, (None, 9), jnp.bfloat16, segments=True),
                 id="bf16-segments"),
]


@pytest.mark.parametrize("shape", DEFAULT_CASES)
def test_default_launches_match_reference(shape):
    check_gradients(shape, None)


def test_public_entry_point_runs_the_default_launches():
    check_gradients(Shape(1, 50, 2, 1, 16, (None, 9)), None, scale=0.3, public=True)


def test_compiled_mode_on_cpu_is_a_clear_error():
    if jax.default_backend() == "gpu":
        pytest.skip("a GPU is present")
    q = jnp.zeros((1, 8, 1, 16))
    with pytest.raises(ValueError, match="pallas_gpu.*needs a CUDA GPU"):
        ls_attention(q, q, q, (None,), implementation="pallas_gpu")


def test_hopper_dkdv_of_some_heads_needs_one_kv_head_per_query_head():
    """dK/dV sums a GQA group in one program, so a launch over some heads takes no GQA."""
    T, H, G, D = 128, 4, 2, 64
    every = launches(H, G, [("hopper", None, FWD2)], [("hopper", None, BWD2)])
    plan = make_plan(seq_len=T, head_dim=D, windows=(None,) * H, num_kv_heads=G,
                     dtype=jnp.bfloat16, scale=0.1, logit_stats=False, interpret=True, batch=1,
                     has_segments=False, launches=every)
    q = jnp.zeros((1, T, H, D), jnp.bfloat16)
    kv = jnp.zeros((1, T, G, D), jnp.bfloat16)
    rows = jnp.zeros((1, H, T), jnp.float32)
    with pytest.raises(ValueError, match=r"^dkdv_call: heads=\(0,\) needs one kv head per "
                                         r"query head, got 2 kv heads for 4$"):
        mosaic_backward.dkdv_call(plan, BWD2, (0,), q, kv, kv, q, rows, rows)


def test_row_delta_of_some_heads():
    rng = np.random.default_rng(7)
    out, do = (rng.standard_normal((2, 5, 4, 8)).astype(np.float32) for _ in range(2))
    want = np.zeros((2, 4, 5), np.float32)
    for h in (0, 2):
        want[:, h] = (out[:, :, h] * do[:, :, h]).sum(-1)
    np.testing.assert_allclose(mosaic_backward.row_delta(out, do, heads=(0, 2)), want,
                               rtol=1e-5, atol=1e-6)
    every = mosaic_backward.row_delta(out, do, heads=(0, 1, 2, 3))
    np.testing.assert_allclose(every[:, 1], (out[:, :, 1] * do[:, :, 1]).sum(-1), rtol=1e-5,
                               atol=1e-6)


@pytest.mark.parametrize("window,o_slots", [(128, 0), (64, 2)],
                         ids=["o-in-the-dq-tiles", "o-tiles-of-their-own"])
def test_strip_backward_makes_delta_itself(window, o_slots):
    """The local heads' backward as strips reads O and makes delta in the kernel: the gradient
    of an all-local call lowered for a Hopper GPU (its shared memory within the budget) is the
    kernels' launches and no XLA arithmetic on O and dO."""
    from ls_jax.interop.export import export
    q = jax.ShapeDtypeStruct((1, 8192, 4, 64), jnp.bfloat16)
    gpu = "NVIDIA H100 80GB HBM3"  # the target a CPU machine names for the GPU lowering
    case = heuristics.Case(dtype=jnp.bfloat16, head_dim=64, windows=(window,) * 4, seq_len=8192,
                           batch=1, num_kv_heads=4, has_segments=False,
                           gpu=heuristics.gpu_of_kind(gpu))
    (strips,) = heuristics.launches(case).backward
    assert strips.lowering == "strip" and strips.config.o_slots == o_slots

    def loss(q, k, v):
        out = ls_attention(q, k, v, (window,) * 4, implementation="pallas_gpu")
        return jnp.sum(out.astype(jnp.float32))

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    text = export(grad, platforms=("cuda",), gpu=gpu)(q, q, q).mlir_module()
    ops = collections.Counter(re.findall(r"stablehlo\.(\w+)", text))
    assert ops["custom_call"] >= 2  # the forward and the strip backward
    assert not {"dot_general", "reduce", "multiply"} & set(ops), ops


def test_interpreter_runs_three_consumers_only_with_processors_enough(monkeypatch):
    """Pallas' GPU interpreter runs one warpgroup per CPU execution slot (one more than
    PJRT_NPROC): three consumers and a producer hung it on 2 processors; the plan falls back
    to two consumers there (same results)."""
    monkeypatch.setenv("PJRT_NPROC", "2")
    assert interpreter_consumers(2) == 2 and interpreter_consumers(3) == 2
    monkeypatch.setenv("PJRT_NPROC", "8")
    assert interpreter_consumers(3) == 3


# ---------------------------------------------------------------------------------------------
# Launches lowered for the GPU on the CPU: the GPU code paths that the interpreter
# does not run (register-operand and overlapped wgmma, set_max_registers), the Triton kernels'
# lowering, and every launch's shared memory (the Mosaic GPU lowering refuses a kernel whose
# buffers exceed it)

# a Hopper GPU as the lowering's target (Pallas' Triton lowering asks for the device kind)
HOPPER_TARGET = jax.sharding.AbstractMesh(
    (1,), ("x",), (jax.sharding.AxisType.Explicit,),
    abstract_device=jax.sharding.AbstractDevice(device_kind="NVIDIA H100 80GB HBM3",
                                                num_cores=132, platform="gpu"))


def lower_for_gpu(fn, *args) -> str:
    with jax.sharding.use_abstract_mesh(HOPPER_TARGET):
        return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",)).as_text()


def kernel_calls(text: str) -> collections.Counter:
    return collections.Counter(re.findall(r"custom_call @(mosaic_gpu\w*|\S*triton)\(", text))


def decided(D, windows, seq_len, batch, kv=None) -> Launches:
    """The heuristics' launches for a case on a Hopper GPU (``kv`` heads; default: MHA)."""
    case = heuristics.Case(dtype=jnp.bfloat16, head_dim=D, windows=windows, seq_len=seq_len,
                           batch=batch, num_kv_heads=kv or len(windows), has_segments=False,
                           gpu=heuristics.Gpu(hopper=True, sms=132))
    return heuristics.launches(case)


BWD3 = dataclasses.replace(BWD2, consumers=3)
WIDE_FWD3 = HopperForwardConfig(block_k=128, consumers=3)
LOWERING_CASES = [
    pytest.param(64, (None, 128, 50, 256), 4,
                 launches(4, 4, [("hopper", (0,), WIDE_FWD3),
                                 ("strip", (1, 2, 3), StripConfig(strip_blocks=4))],
                          [("hopper", (0,), BWD3), ("triton", (1, 2, 3), TritonConfig())]),
                 id="d64-mix-strips-3-consumers"),
    # every window the padded length: a constant the kernels capture
    pytest.param(64, (None,) * 4, 2,
                 launches(4, 2, [("hopper", None, WIDE_FWD3)], [("hopper", None, BWD3)]),
                 id="d64-all-global-gqa-3-consumers"),
    pytest.param(128, (None, None, 300, None), 4,
                 launches(4, 4, [("hopper", None, HopperForwardConfig(block_k=128))],
                          [("hopper", None, HopperBackwardConfig(dq_block_k=128,
                                                                 dq_delta=False))]),
                 id="d128-128-key-dq-blocks-delta-by-xla"),
    pytest.param(128, (None, 512, 256, 512), 2,
                 launches(4, 2, [("hopper", None, WIDE_FWD3)], [("hopper", None, BWD2)]),
                 id="d128-every-head-3-consumers-gqa"),
    pytest.param(64, (None,) + (128,) * 15, 16, decided(64, (None,) + (128,) * 15, 32768, 4),
                 id="decided-d64-long-mix"),
    # the local heads' fused strip backward after the global heads' Hopper one
    pytest.param(64, (None,) + (50,) * 7, 8, decided(64, (None,) + (50,) * 7, 8192, 4),
                 id="decided-d64-narrow-mix-strip-backward"),
    pytest.param(64, (64, 50, 65, 1), 4,
                 launches(4, 4, [("strip", None, StripConfig(strip_blocks=4))],
                          [("strip", None, StripBackwardConfig(sub_blocks=3))]),
                 id="d64-all-local-strips"),
    # heads of one window: one-pass strips; the strip backward's static masks, one K/V slot
    pytest.param(64, (None, 128, 128, 128), 4,
                 launches(4, 4, [("hopper", (0,), WIDE_FWD3),
                                 ("strip", (1, 2, 3), StripConfig(strip_blocks=4, one_pass=True))],
                          [("hopper", (0,), BWD2),
                           ("strip", (1, 2, 3), StripBackwardConfig(sub_blocks=4, kv_slots=1))]),
                 id="d64-one-window-strips-one-kv-slot"),
    # local windows of at least four 128-key blocks: every head on the Hopper kernels
    pytest.param(64, (None, 512, 600, 1000), 4, decided(64, (None, 512, 600, 1000), 8192, 4),
                 id="decided-d64-wide-windows"),
    # a long GQA mix: every head on the Hopper backward, groups of a global and local heads
    pytest.param(64, (None, 128, 64, 100), 1, decided(64, (None, 128, 64, 100), 8192, 2, kv=1),
                 id="decided-d64-long-gqa-mix"),
    # ... every head local (128-key blocks)
    pytest.param(64, (2048, 3000, 2048, 4000), 4, decided(64, (2048, 3000, 2048, 4000), 8192, 2),
                 id="decided-d64-all-local-wide-windows"),
    # one local head past head 0: its index and window are constants the kernels capture
    pytest.param(64, (None, 128), 2,
                 launches(2, 2, [("hopper", (0,), WIDE_FWD3),
                                 ("strip", (1,), StripConfig(strip_blocks=4, one_pass=True))],
                          [("hopper", (0,), BWD2),
                           ("strip", (1,), StripBackwardConfig(sub_blocks=4, kv_slots=1))]),
                 id="d64-one-local-head-one-kv-slot"),
]


@pytest.mark.parametrize("D,windows,kv,chosen", LOWERING_CASES)
def test_launches_lower_for_the_gpu(D, windows, kv, chosen):
    """Forward and backward of a call, lowered for a Hopper GPU: every launch is one kernel of
    its lowering (two in the backward, dQ and dK/dV, but for the fused strip backward) and
    nothing else is; a later launch's buffers are aliased to the earlier one's outputs, not
    copied."""
    H, T = len(windows), 1024
    q = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16)
    k = jax.ShapeDtypeStruct((1, T, kv, D), jnp.bfloat16)

    def loss(q, k, v):
        out, stats = pallas_gpu_attention(q, k, v, windows, launches=chosen,
                                          return_logit_stats=True)
        return jnp.sum(out.astype(jnp.float32)) + jnp.sum(stats)

    text = lower_for_gpu(jax.grad(loss, (0, 1, 2)), q, k, k)
    calls = kernel_calls(text)
    got = {"mosaic": sum(n for c, n in calls.items() if c.startswith("mosaic")),
           "triton": sum(n for c, n in calls.items() if c.endswith("triton"))}
    want = {"mosaic": 0, "triton": 0}
    for backward, passes in ((False, chosen.forward), (True, chosen.backward)):
        for launch in passes:
            kernels = 2 if backward and launch.lowering != "strip" else 1
            want["triton" if launch.lowering == "triton" else "mosaic"] += kernels
    assert got == want, calls
    # aliased: out, lse2 and statistics of each later forward launch; dq, dk and dv of each
    # later backward launch
    later = len(chosen.forward) - 1 + len(chosen.backward) - 1
    assert text.count("output_operand_alias<") == 3 * later


def test_dq_delta_that_does_not_fit_is_refused_by_the_lowering():
    """The shared memory the heuristics count is the lowering's: a dQ kernel with O's tile
    that ``delta_fits`` rejects does not lower, the same config without it does."""
    config = HopperBackwardConfig(block_q=128, block_k=64, dq_block_k=64, consumers=2)
    assert not heuristics.delta_fits(config, 128, 2)
    T, H, D = 512, 2, 128
    plan = make_plan(seq_len=T, head_dim=D, windows=(None,) * H, num_kv_heads=H,
                     dtype=jnp.bfloat16, scale=0.1, logit_stats=False, interpret=False,
                     batch=1, has_segments=False,
                     launches=launches(H, H, [("hopper", None, FWD2)],
                                       [("hopper", None, config)]))
    x = jax.ShapeDtypeStruct((1, T, H, D), jnp.bfloat16)
    rows = jax.ShapeDtypeStruct((1, H, T), jnp.float32)

    def dq(config):
        return lambda q, k, v, do, lse2, out: mosaic_backward.dq_call(
            plan, config, (0, 1), q, k, v, do, lse2, out=out)

    assert "mosaic_gpu" in lower_for_gpu(dq(dataclasses.replace(config, dq_delta=False)),
                                         x, x, x, x, rows, x)
    with pytest.raises(ValueError, match="exceeds available shared memory"):
        lower_for_gpu(dq(dataclasses.replace(config, dq_delta=True)), x, x, x, x, rows, x)


# ---------------------------------------------------------------------------------------------
# Which blocks the kernels visit, against brute force

def tile_state(q_block, k_block, bq, bk, window):
    """(any pair of the tile allowed, every pair allowed)."""
    allowed = [(j <= i) and (window is None or i - j < window)
               for i in range(q_block * bq, (q_block + 1) * bq)
               for j in range(k_block * bk, (k_block + 1) * bk)]
    return any(allowed), all(allowed)


@pytest.mark.parametrize("bq,bk", [(16, 16), (32, 16), (16, 32)])
def test_loop_splits_cover_exactly_the_band(bq, bk):
    T = 128
    for window in (None, 1, 5, 16, 17, 40, 127, 300):
        for i in range(T // bq):
            first, lo, hi, end = (int(x) for x in split_kv_loop(i, bq, bk, window, T))
            assert first <= lo <= hi <= end
            for j in range(T // bk):
                touches, full = tile_state(i, j, bq, bk, window)
                assert (first <= j < end) == touches, (window, i, j)
                assert not lo <= j < hi or full, ("unmasked tile outside the band", window, i, j)
        for j in range(T // bk):
            first, lo, hi, end = (int(x) for x in split_q_loop(j, bq, bk, window, T))
            assert first <= lo <= hi <= end
            for i in range(T // bq):
                touches, full = tile_state(i, j, bq, bk, window)
                assert (first <= i < end) == touches, (window, i, j)
                assert not lo <= i < hi or full, ("unmasked tile outside the band", window, i, j)


def test_full_ranges_are_exact():
    T, bq, bk = 96, 16, 32
    for window in (None, 1, 20, 48, 49, 96):
        for i in range(T // bq):
            f, e = kv_full_block_range(i, bq, bk, window, T)
            want = [j for j in range(T // bk) if tile_state(i, j, bq, bk, window)[1]]
            assert list(range(f, min(e, T // bk))) == want
        for j in range(T // bk):
            f, e = q_full_block_range(j, bq, bk, window, T)
            want = [i for i in range(T // bq) if tile_state(i, j, bq, bk, window)[1]]
            assert list(range(f, min(e, T // bq))) == want


def test_band_blocks_counts_either_side_of_a_band_past_the_start():
    """``band.band_blocks``: the key blocks of a query block and the query blocks reaching a
    key block, for blocks whose band starts past the sequence's first block."""
    T, block = 4096, 16
    for window in (1, 2, 15, 16, 17, 31, 32, 33, 100):
        i = window // block + 2  # a band that starts past key 0, ends before T
        first, end = kv_block_range(i, block, block, window, T)
        assert end - first == band_blocks(window, block), window
        first, end = q_block_range(i, block, block, window, T)
        assert end - first == band_blocks(window, block), window


@pytest.mark.parametrize("heads", [(0, 1, 2, 3, 4, 5), (1, 3, 4)], ids=["every-head", "some"])
def test_program_order_covers_each_program_once_longest_first(heads):
    windows, T, bq, bk = (256, 3, 64, 256, 1, 64), 256, 32, 16
    order = program_order(tuple((w,) for w in windows), heads, T, bq, bk, False)
    n_q = T // bq
    assert sorted(order.tolist()) == [h * n_q + i for h in heads for i in range(n_q)]
    visits = [np.subtract(*kv_block_range(int(x) % n_q, bq, bk, windows[int(x) // n_q], T)[::-1])
              for x in order]
    assert visits == sorted(visits, reverse=True)

    groups = tuple(windows[2 * g:2 * g + 2] for g in range(3))  # kv head g: query heads 2g, 2g+1
    kv_heads = tuple(sorted({h // 2 for h in heads}))
    order = program_order(groups, kv_heads, T, bq, bk, True)
    n_k = T // bk
    assert sorted(order.tolist()) == [g * n_k + j for g in kv_heads for j in range(n_k)]
    visits = [sum(np.subtract(*q_block_range(int(x) % n_k, bq, bk, w, T)[::-1])
                  for w in groups[int(x) // n_k]) for x in order]
    assert visits == sorted(visits, reverse=True)


# ---------------------------------------------------------------------------------------------
# GPU only: the compiled kernels in 16-bit at realistic sizes

GPU_CASES = [
    pytest.param(Shape(2, 2048, 8, 8, 64, (None,) + (128,) * 7, jnp.bfloat16), id="d64-mix"),
    pytest.param(Shape(1, 3000, 8, 2, 128, (None, 50, 512, 1, None, 128, 3000, 7),
                       jnp.bfloat16), id="d128-mix-gqa-padded"),
    pytest.param(Shape(2, 1536, 6, 3, 32, (50,) * 6, jnp.bfloat16), id="d32-all-local"),
    pytest.param(Shape(1, 1024, 4, 4, 64, (None,) * 4, jnp.bfloat16), id="d64-all-global"),
    pytest.param(Shape(1, 1024, 2, 2, 128, (None,) * 2, jnp.bfloat16), id="d128-all-global"),
    pytest.param(Shape(2, 1000, 4, 4, 128, (50, 512, 1, 128), jnp.bfloat16),
                 id="d128-all-local"),
    # every window at least two 64-key blocks: every head on the Hopper forward
    pytest.param(Shape(2, 1000, 4, 2, 128, (128, 200, 512, 129), jnp.bfloat16),
                 id="d128-all-local-wide-gqa-padded"),
    # ... two 128-key blocks: on 128-key blocks
    pytest.param(Shape(2, 1000, 4, 2, 128, (256, 300, 999, 256), jnp.bfloat16),
                 id="d128-all-local-wider-gqa-padded"),
    # beyond the Hopper kernels' head sizes: Triton's smaller tiles (D=192 padded to 256)
    pytest.param(Shape(1, 700, 4, 2, 192, (None, 50, 128, None), jnp.bfloat16),
                 id="d192-mix-padded"),
    pytest.param(Shape(1, 1024, 2, 2, 256, (None, None), jnp.bfloat16), id="d256-all-global"),
    pytest.param(Shape(1, 600, 2, 1, 256, (None, 100), jnp.float32), id="fp32-d256-mix"),
    # every head on the Hopper forward with three consumers (8 x 16 heads x 9 tiles)
    pytest.param(Shape(8, 1550, 16, 4, 128, (None, 256, 512, 300, None, 1549, 700)
                       + (256,) * 9, jnp.bfloat16), id="d128-wide-windows-gqa"),
    pytest.param(Shape(2, 1024, 8, 2, 64, (None,) * 8, jnp.bfloat16), id="d64-gqa-groups-of-4"),
    # strips from STRIP_MIN_SEQ_LEN; the global heads' Hopper backward (three consumers with
    # programs enough) beside the local heads' Triton one
    pytest.param(Shape(2, 8192, 8, 8, 64, (None, 128, None, 50, 128, 256, 1, 200),
                       jnp.bfloat16), id="d64-long-mix-strips"),
    pytest.param(Shape(1, 4000, 8, 2, 64, (None, 50, 512, 1, None, 128, 4000, 7),
                       jnp.float16), id="fp16-d64-mix-gqa-padded"),
    # the local heads of one window: strips softmax a whole band in one pass (window 100:
    # three key blocks, each masked)
    pytest.param(Shape(2, 4500, 8, 4, 64, (None,) + (100,) * 7, jnp.bfloat16),
                 id="d64-one-window-strips-gqa-padded"),
    # the local heads' fused strip backward (windows up to 65) beside the global heads'
    pytest.param(Shape(2, 8192, 8, 8, 64, (None, 64, 1, 50, None, 65, 32, 7), jnp.bfloat16),
                 id="d64-long-narrow-mix-strip-backward"),
    # ... with one K/V slot for heads of one window of 128
    pytest.param(Shape(1, 8300, 4, 4, 64, (None, 128, 128, 128), jnp.bfloat16),
                 id="d64-one-window-128-strip-backward-padded"),
    # local windows of at least four 128-key blocks: every head on the Hopper kernels, GQA
    pytest.param(Shape(1, 8192, 4, 2, 64, (None, 512, 600, 1000), jnp.bfloat16),
                 id="d64-wide-windows-gqa"),
    # ... every head local
    pytest.param(Shape(1, 8192, 4, 2, 64, (2048, 3000, 2048, 4000), jnp.bfloat16),
                 id="d64-all-local-wide-windows-gqa"),
    # a long GQA mix of narrow windows: every head on the Hopper backward, groups of 4
    pytest.param(Shape(1, 8192, 8, 2, 64, (None, 128, 64, 100, None, 128, 1, 128),
                       jnp.bfloat16), id="d64-long-gqa-mix"),
    # the strip backward over one local head past head 0 (its index a constant)
    pytest.param(Shape(1, 8192, 2, 2, 64, (None, 128), jnp.bfloat16),
                 id="d64-one-local-head-strip-backward"),
]


def _poison_device_memory(nbytes: int):
    """Fills freed device memory with NaN, so an output element no kernel writes would read
    NaN (XLA's allocator hands freed chunks back out)."""
    junk = [jnp.full((nbytes // 2,), jnp.nan, jnp.bfloat16) for _ in range(4)]
    jax.block_until_ready(junk)
    del junk


def gpu_check(shape: Shape, launches: Launches | None, public: bool):
    """Forward (out, lse, statistics) and gradients of the compiled call against the
    reference in float32; rounding-sized tolerances for 16-bit inputs."""
    q, k, v, do, seg = shape.inputs()
    f32 = [x.astype(jnp.float32) for x in (q, k, v, do)]
    want_out, want_lse, want_max = reference_attention_parts(*f32[:3], shape.windows, seg)
    _poison_device_memory(q.size * 2)
    if public:
        out, stats = jax.jit(lambda q, k, v: ls_attention(
            q, k, v, shape.windows, segment_ids=seg, implementation="pallas_gpu",
            return_logit_stats=True))(q, k, v)
        stats = stats.max_abs_logit
    else:
        out, lse, stats = jax.jit(lambda q, k, v: pallas_gpu_attention_parts(
            q, k, v, shape.windows, segment_ids=seg, launches=launches))(q, k, v)
        assert rel_err(lse, want_lse) < 1e-3
    assert rel_err(out, want_out) < 1e-2
    assert rel_err(stats, want_max) < 1e-2

    def ours(q, k, v):
        if public:
            o = ls_attention(q, k, v, shape.windows, segment_ids=seg,
                             implementation="pallas_gpu")
        else:
            o = pallas_gpu_attention(q, k, v, shape.windows, segment_ids=seg,
                                     launches=launches)[0]
        return jnp.sum(o.astype(jnp.float32) * f32[3])

    def ref(q, k, v):
        return jnp.sum(reference_attention_parts(q, k, v, shape.windows, seg)[0] * f32[3])

    _poison_device_memory(q.size * 2)
    got = jax.jit(jax.grad(ours, (0, 1, 2)))(q, k, v)
    want = jax.grad(ref, (0, 1, 2))(*f32[:3])
    for name, g, w in zip(("dq", "dk", "dv"), got, want):
        assert rel_err(g, w) < 1e-2, name


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_CASES)
def test_gpu_default_launches_match_reference(shape):
    gpu_check(shape, None, public=True)


def gpu_variants(shape: Shape) -> dict[str, Launches]:
    """Named launches for a shape on this GPU: the heuristics', every head on Triton, and where
    the Hopper kernels run every head on them with 2 and with 3 consumers (delta in the dQ
    kernel where it fits), the local heads as strips (D=64, windows whose ring fits), and their
    backward as fused strips with one and with two K/V slots where the buffers fit (one kv
    head per query head)."""
    gpu = heuristics.current_gpu()
    case = heuristics.Case(dtype=shape.dtype, head_dim=shape.D, windows=shape.windows,
                           seq_len=shape.T, batch=shape.B, num_kv_heads=shape.G,
                           has_segments=shape.segments, gpu=gpu)
    H, G = shape.H, shape.G
    variants = {"default": heuristics.launches(case),
                "triton": triton(H, G, heuristics.triton_config(case))}
    if not heuristics.hopper_runs(case):
        return variants
    for c in (2, 3):
        if c == 3 and shape.D > 64:
            continue
        bwd = HopperBackwardConfig(block_q=64, block_k=64, dq_block_k=64, consumers=c)
        bwd = dataclasses.replace(bwd, dq_delta=heuristics.delta_fits(bwd, shape.D, 2))
        variants[f"hopper-{c}-consumers"] = launches(
            H, G, [("hopper", None, HopperForwardConfig(consumers=c))], [("hopper", None, bwd)])
    glob, local = case.global_heads(), case.local_heads()
    if local and heuristics.strip_fits(case, local):
        first = [("hopper", glob, heuristics.hopper_forward(case, glob))] if glob else []
        variants["strips"] = launches(
            H, G, first + [("strip", local, heuristics.strip_config(case, local))],
            [("hopper", None, heuristics.hopper_backward(case))])
    first = [("hopper", glob, heuristics.hopper_backward(case))] if glob else []
    for kv_slots in (1, 2):
        if local and H == G and heuristics.strip_backward_fits(case, local, kv_slots):
            config = dataclasses.replace(heuristics.strip_backward_config(case, local),
                                         kv_slots=kv_slots)
            variants[f"strip-backward-{kv_slots}-kv-slots"] = launches(
                H, G, [("triton", None, heuristics.triton_config(case))],
                first + [("strip", local, config)])
    return variants


GPU_VARIANT_SHAPES = [
    pytest.param(Shape(1, 3000, 8, 2, 64, (None, 50, 512, 1, None, 128, 3000, 7),
                       jnp.bfloat16), id="d64-mix-gqa-padded"),
    pytest.param(Shape(2, 2048, 8, 8, 64, (None, 128, None, 50, 128, 256, 1, 2048),
                       jnp.bfloat16), id="d64-mix"),
    pytest.param(Shape(1, 2900, 8, 8, 128, (None, 50, 512, 1, None, 128, 2900, 7),
                       jnp.bfloat16), id="d128-mix-padded"),
    pytest.param(Shape(2, 2048, 4, 4, 64, (None,) * 4, jnp.bfloat16), id="d64-all-global"),
    # the fused strip backward (windows up to 65), beside global heads and every head local
    pytest.param(Shape(2, 2048, 6, 6, 64, (None, 64, 1, 50, 65, 7), jnp.bfloat16),
                 id="d64-narrow-mix"),
    pytest.param(Shape(1, 3000, 4, 4, 64, (32, 50, 65, 1), jnp.bfloat16),
                 id="d64-all-local-padded"),
    # heads of one window: masks with static bounds, the band's middle block unmasked
    pytest.param(Shape(2, 2100, 6, 6, 64, (None,) + (128,) * 5, jnp.bfloat16),
                 id="d64-one-window-128-mix-padded"),
]


@pytest.mark.gpu
@pytest.mark.parametrize("shape", GPU_VARIANT_SHAPES)
def test_gpu_launch_variants_match_reference(shape):
    for name, chosen in gpu_variants(shape).items():
        try:
            gpu_check(shape, chosen, public=False)
        except AssertionError as error:
            raise AssertionError(f"launches {name!r}: {chosen}") from error


@pytest.mark.gpu
def test_gpu_segment_ids_and_fp16():
    gpu_check(Shape(2, 1000, 4, 2, 64, (None, 64, 1, 300), jnp.float16, segments=True), None,
              public=True)


@pytest.mark.gpu
def test_gpu_float32_matches_reference():
    shape = Shape(1, 600, 2, 1, 64, (None, 100))
    q, k, v, _, _ = shape.inputs()
    out = ls_attention(q, k, v, shape.windows, implementation="pallas_gpu")
    # float32 dots run on the matrix units in tf32
    assert rel_err(out, reference_attention_parts(q, k, v, shape.windows)[0]) < 2e-3


# ---------------------------------------------------------------------------------------------
# bench/attention.py

def _load_attention_benchmark(monkeypatch):
    """bench/attention.py as a module."""
    import importlib.util
    import pathlib

    folder = pathlib.Path(__file__).resolve().parents[1] / "bench"
    monkeypatch.syspath_prepend(str(folder))  # the script imports its neighbour hardware.py
    spec = importlib.util.spec_from_file_location("bench_attention", folder / "attention.py")
    bench = importlib.util.module_from_spec(spec)
    with warnings.catch_warnings():  # (it sets warning filters as it loads)
        spec.loader.exec_module(bench)
    return bench


def test_benchmark_launch_variants(monkeypatch):
    """--launches: "default" leaves the choice to the heuristics, "all-mosaic" puts every
    Triton launch of a Hopper case on the Mosaic kernels, "triton-backward" the local heads'
    strip backward on the Triton kernels, "one-triton-backward" the whole backward in one
    Triton launch; anything else is refused."""
    bench = _load_attention_benchmark(monkeypatch)
    monkeypatch.setattr(heuristics, "current_gpu",
                        lambda interpret=False: heuristics.Gpu(hopper=True, sms=132))
    windows = (None,) + (128,) * 15
    assert bench.choose_launches("default", jnp.bfloat16, 64, windows, 8192, 4, 16) is None
    every = bench.choose_launches("all-mosaic", jnp.bfloat16, 64, windows, 8192, 4, 16)
    assert every.forward and every.backward
    assert all(l.lowering != "triton" for l in every.forward + every.backward)
    narrow = (None,) + (50,) * 15
    assert [l.lowering for l in bench.choose_launches(
        "triton-backward", jnp.bfloat16, 64, narrow, 8192, 4, 16).backward] == ["hopper",
                                                                                 "triton"]
    assert [l.lowering for l in heuristics.launches(heuristics.Case(
        dtype=jnp.bfloat16, head_dim=64, windows=narrow, seq_len=8192, batch=4,
        num_kv_heads=16, has_segments=False, gpu=heuristics.current_gpu())).backward] == [
        "hopper", "strip"]
    one = bench.choose_launches("one-triton-backward", jnp.bfloat16, 64, windows, 8192, 4, 16)
    assert [(l.lowering, l.heads) for l in one.backward] == [("triton", tuple(range(16)))]
    with pytest.raises(ValueError, match="--launches: expected names among"):
        bench.choose_launches("fastest", jnp.bfloat16, 64, windows, 8192, 4, 16)


def test_benchmark_cut_short_by_sigterm_prints_its_rows(monkeypatch, capsys):
    """A sweep that ``timeout`` ends (SIGTERM) prints the table of the rows it measured and
    exits non-zero; the handler is put back."""
    import signal
    import sys

    bench = _load_attention_benchmark(monkeypatch)
    row = {"D": 128, "n": 4096, "p": 512, "mix": "1g15l", "impl": "ours", "fwd_ms": 0.25,
           "fb_ms": 0.75}

    def sweep(args, rows):
        rows.append(row)
        signal.raise_signal(signal.SIGTERM)  # as `timeout` does
        rows.append(dict(row, impl="never measured"))

    monkeypatch.setattr(bench, "run_sweep", sweep)
    monkeypatch.setattr(sys, "argv", ["attention.py"])
    before = signal.getsignal(signal.SIGTERM)
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 1
    assert signal.getsignal(signal.SIGTERM) is before
    out = capsys.readouterr().out
    assert "| 128 | 4096 | 512 | 1g15l | ours | 0.250 |" in out
    assert "never measured" not in out
    assert "stopped by SIGTERM after 1 rows" in out


def test_benchmark_gqa_inputs_and_floor_bytes(monkeypatch, capsys):
    """bench/attention.py --kv-heads: k and v get the kv heads, the floor counts their bytes
    (by hand: B=1, n=64, D=16 bf16, a q-sized tensor 16 KiB at 8 heads, a kv-sized 4 KiB at 2;
    forward q, o, k, v; the backward adds q, o, do, dq, k, v, dk, dv), and a count that does
    not divide --heads, or GQA with triton_mha, is refused with one line."""
    import sys

    bench = _load_attention_benchmark(monkeypatch)
    sets = bench.make_input_sets(1, 64, 8, 16, jnp.bfloat16, seed=0, kv_heads=2)
    assert [x.shape for x in sets[0]] == [(1, 64, 8, 16), (1, 64, 2, 16), (1, 64, 2, 16),
                                          (1, 64, 8, 16)]
    monkeypatch.setattr(bench, "peaks", lambda kind: (1e30, 1e9))  # memory bound: bytes / 1e9
    ms = 1e3 * 40960 / 1e9  # the forward's bytes: 2 x 16384 + 2 x 4096
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, False, 2) == pytest.approx(100)
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, True, 2) == pytest.approx(300)
    # one kv head per query head: 4 q-sized tensors forward, 12 with the backward
    assert bench.floor_pct(ms, 1, 64, 8, 16, (None,) * 8, True) == pytest.approx(
        100 * 12 * 16384 / 40960)
    refusals = [
        (["--kv-heads", "5"], "--kv-heads: expected 0 or a divisor of --heads (16), got 5"),
        (["--kv-heads", "-4"], "--kv-heads: expected 0 or a divisor of --heads (16), got -4"),
        # the default --impl holds triton_mha, which takes no GQA
        (["--kv-heads", "4"], "--kv-heads: triton_mha takes one kv head per query head"),
    ]
    for flags, message in refusals:
        monkeypatch.setattr(sys, "argv", ["attention.py", "--heads", "16", *flags])
        with pytest.raises(SystemExit) as exit_info:
            bench.main()
        assert exit_info.value.code == 2
        assert message in capsys.readouterr().err
