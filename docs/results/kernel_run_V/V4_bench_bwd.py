"""bench/attention.py with one scratch knob: --cfg strip_blocks=1 (unused at D=128) runs the
Hopper dK/dV kernel per query head with XLA's group sum after it (run U's way)."""
import runpy
import sys

from ls_jax.kernels.pallas_gpu import backward as bw

_orig = bw.dkdv_call_mosaic


def _dkdv(plan, *args, **kwargs):
    if plan.config.strip_blocks == 1 and plan.head_dim_padded == 128:
        kwargs["sum_groups"] = False
    return _orig(plan, *args, **kwargs)


bw.dkdv_call_mosaic = _dkdv
sys.path.insert(0, "bench")
sys.argv = ["bench/attention.py"] + sys.argv[1:]
runpy.run_path("bench/attention.py", run_name="__main__")
