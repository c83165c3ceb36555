"""Experiment (run Q): the Mosaic backward with three consumer warpgroups (a patched copy of
backward_mosaic.py: CONSUMERS = 3 at 160/24 registers, the last tile's extra consumers redo
the last block, as in the forward). ``patched()`` returns the module; ``use(mod)`` points
backward.py at its kernels."""
import types
import ls_jax.kernels.pallas_gpu.backward_mosaic as bm
import ls_jax.kernels.pallas_gpu.backward as bw

REPLACEMENTS = [
    ("FUSED_BLOCK_Q = 64", "CONSUMERS = 3\nCONSUMER_REGISTERS, PRODUCER_REGISTERS = 160, 24\nFUSED_BLOCK_Q = 64"),
    ("tile_union(kv_block_range, tile, block_q, block_k, window, seq_len)",
     "tile_union(kv_block_range, tile, block_q, block_k, window, seq_len, consumers=CONSUMERS, num_blocks=seq_len // block_q)"),
    ("tile_union(q_block_range, tile, block_q, block_k, window, seq_len)",
     "tile_union(q_block_range, tile, block_q, block_k, window, seq_len, consumers=CONSUMERS, num_blocks=seq_len // block_k)"),
    ("q_block = CONSUMERS * tile + wg", "q_block = jnp.minimum(CONSUMERS * tile + wg, seq_len // block_q - 1)"),
    ("k_block = CONSUMERS * tile + wg", "k_block = jnp.minimum(CONSUMERS * tile + wg, seq_len // block_k - 1)"),
    ("num_tiles = Tp // (CONSUMERS * bq)", "num_tiles = -(-Tp // (CONSUMERS * bq))"),
    ("num_tiles = Tp // (CONSUMERS * bk)", "num_tiles = -(-Tp // (CONSUMERS * bk))"),
    ("num_tiles=num_tiles, batch=B, interpret=plan.interpret)(", "num_tiles=num_tiles, batch=B, interpret=plan.interpret, consumers=CONSUMERS)("),
    ("                      interpret=plan.interpret)\n", "                      interpret=plan.interpret, consumers=CONSUMERS)\n"),
    ("end=union_end, stages=stages))", "end=union_end, stages=stages, registers=PRODUCER_REGISTERS))"),
]


def patched():
    src = open(bm.__file__).read()
    for old, new in REPLACEMENTS:
        assert src.count(old) == 1, old
        src = src.replace(old, new)
    mod = types.ModuleType("backward_mosaic_c3")
    mod.__file__ = bm.__file__
    exec(compile(src, "backward_mosaic_c3", "exec"), mod.__dict__)
    return mod


def use(mod):
    bw.dq_call_mosaic = mod.dq_call_mosaic
    bw.dkdv_call_mosaic = mod.dkdv_call_mosaic
