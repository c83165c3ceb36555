"""The strip forward's ring protocol (``mosaic/ring.walk_strip`` and ``produce``), checked
without a GPU or the interpreter: each consumer's walk is run eagerly (``jax.disable_jit``)
with its waits and releases recorded, then replayed against a model of the producer (a block
is loaded once every consumer has released the block its ring slot held). A protocol
deadlock, which hangs a GPU silently (a strip backward on a ring shorter than the forward's
rule does), fails here; so does a block waited or released twice or not at all, or a
band block read after its release. The interpreter tests run the kernel on a few short
sequences only; this covers windows 1-256 and strips of 1-16 blocks."""

from __future__ import annotations

import itertools

import jax
import pytest

from ls_jax.kernels.band import kv_block_range
from ls_jax.kernels.pallas_gpu.mosaic.ring import strip_bounds, strip_share, walk_strip
from ls_jax.kernels.pallas_gpu.mosaic.strip import strip_stages

BLOCK = 64


def consumer_actions(window, seq_len, tile, strip, wg, consumers):
    """The recorded ("wait" | "release" | "read", block) actions of consumer ``wg`` of strip
    ``tile``, and the strip's streamed blocks [stream_first, stream_end)."""
    actions = []

    def band(i):
        return kv_block_range(int(i), BLOCK, BLOCK, window, seq_len)

    def visit(t, i, wait_streamed):
        first, end = band(i)
        wait_streamed(end)
        actions.extend(("read", j) for j in range(first, end))

    with jax.disable_jit():
        strip_first, strip_end, stream_first, stream_end = strip_bounds(
            kv_block_range, tile, strip, BLOCK, window, seq_len)
        count, own_block = strip_share(strip_first, strip_end, wg, consumers)
        walk_strip(count, own_block, lambda i: band(i + consumers)[0], stream_first,
                   stream_end, lambda j, _: actions.append(("wait", int(j))),
                   lambda j, _: actions.append(("release", int(j))), visit)
    return actions, int(stream_first), int(stream_end)


def replay(per_consumer, stream_first, stream_end, stages):
    """Runs the consumers' actions against the producer model; returns None or what failed."""
    consumers = len(per_consumer)
    loaded, released = set(), {}
    waited = [set() for _ in per_consumer]
    freed = [set() for _ in per_consumer]
    position = [0] * consumers
    produced = stream_first
    while True:
        progress = False
        previous = produced - stages  # the block whose slot the next load takes
        if produced < stream_end and (previous < stream_first
                                      or released.get(previous, 0) == consumers):
            loaded.add(produced)
            produced += 1
            progress = True
        for c, actions in enumerate(per_consumer):
            while position[c] < len(actions):
                kind, j = actions[position[c]]
                if kind == "wait":
                    if j not in loaded:
                        break
                    if j in waited[c]:
                        return f"consumer {c} waits for block {j} twice"
                    waited[c].add(j)
                elif kind == "release":
                    if j not in waited[c] or j in freed[c]:
                        return f"consumer {c} releases block {j} unwaited or twice"
                    freed[c].add(j)
                    released[j] = released.get(j, 0) + 1
                elif j not in waited[c] or j in freed[c]:
                    return f"consumer {c} reads block {j} unwaited or released"
                position[c] += 1
                progress = True
        if produced == stream_end and all(p == len(a) for p, a in zip(position, per_consumer)):
            every = set(range(stream_first, stream_end))
            if any(w != every or f != every for w, f in zip(waited, freed)):
                return "a block not waited for or not released by every consumer"
            return None
        if not progress:
            return f"deadlock: producer at block {produced}, consumers at {position}"


def check(window, num_blocks, strip, consumers, stages):
    """None, or what failed in the first strip (of ``strip`` query blocks) that fails."""
    seq_len = num_blocks * BLOCK
    for tile in range(-(-num_blocks // strip)):
        walks = [consumer_actions(window, seq_len, tile, strip, wg, consumers)
                 for wg in range(consumers)]
        failure = replay([w[0] for w in walks], walks[0][1], walks[0][2], stages)
        if failure:
            return f"strip {tile}: {failure}"
    return None


WINDOWS = (1, 7, 50, 63, 64, 65, 128, 129, 200, 255, 256)
GEOMETRIES = [(16, 1), (16, 2), (16, 3), (16, 5), (16, 16), (40, 7)]  # (blocks, strip)


@pytest.mark.slow
@pytest.mark.parametrize("consumers", [2, 3])
def test_forward_ring_never_deadlocks(consumers):
    """The forward's strips keep every waited block until their block is done, with the ring
    ``strip_stages`` sizes."""
    for window, (blocks, strip) in itertools.product(WINDOWS, GEOMETRIES):
        failure = check(window, blocks, strip, consumers, strip_stages(window, consumers))
        assert failure is None, (window, blocks, strip, failure)


def test_a_short_ring_deadlocks():
    """The check can fail: with six slots for p=256 and three consumers (a dQ strip whose
    shared memory holds no more) each consumer holds the strip's first blocks until its own
    block is done, and the third cannot get its last block: the GPU would hang."""
    failure = check(256, 32, 3, 3, 6)
    assert failure is not None and "deadlock" in failure
    assert strip_stages(256, 3) > 6

