"""bench/attention.py with the cuDNN composition as it was before run S (gathers of heads)."""
import importlib.util, runpy, sys
spec = importlib.util.spec_from_file_location("old_cudnn", "scratch/old_cudnn.py")
old = importlib.util.module_from_spec(spec); spec.loader.exec_module(old)
import ls_jax.kernels.cudnn as new
new.cudnn_backend = old.cudnn_backend
sys.path.insert(0, "bench")
sys.argv = ["bench/attention.py"] + sys.argv[1:]
runpy.run_path("bench/attention.py", run_name="__main__")
