# Run O, 2026-11-27, through the device tool: O1-O9 and O12 on nvidia-h100-x1 (NVIDIA H100 80GB HBM3,
# driver 580.159.04), O10-O11 on nvidia-h100-x2 (two NVIDIA H100 80GB HBM3). Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs; export PYTHONPATH=$PWD
# ---- calls O1-O3: the run-N prototype, from the checkout, with
# scratch/forward_strip.py = ../kernel_run_N/N8_forward_strip.py with REGISTERS[4] = (112, 24)
# scratch/bench_one.py = O1_bench_strip.py (args: n, strip:consumers[:slots],..., p, heads)
timeout 90 python scratch/bench_one.py 8192 32:3                       # O1
timeout 90 python scratch/bench_one.py 8192 32:4
timeout 90 python scratch/bench_one.py 8192 64:4,16:4
timeout 120 python scratch/bench_one.py 32768 32:2,32:3,32:4
timeout 90 python scratch/bench_one.py 8192 64:2,64:2:10               # O2
timeout 90 python scratch/bench_one.py 8192 64:3,64:3:9
for P in 50 128 256; do                                                # O3
  timeout 70 python scratch/bench_one.py 4096 16:3,32:3,32:4 $P
  timeout 70 python scratch/bench_one.py 8192 32:3,64:3,64:4 $P
  timeout 90 python scratch/bench_one.py 32768 64:3,128:3,64:4 $P
done
timeout 70 python scratch/bench_one.py 8192 32:3,64:3 128 15
# ---- call O4: the strip kernel in the package (kernels/pallas_gpu/forward_strip.py), default on
B="python bench/attention.py --d 64 --check"
timeout 200 $B --n 8192 --p 128 --mix 1g15l,local --impl ours,ours_stats,cudnn_ls --reps 10 --cfg "" --cfg local_fwd_lowering=triton --cfg ""
timeout 200 $B --n 32768 --p 128 --mix 1g15l --impl ours,ours_stats,cudnn_ls --reps 8 --cfg "" --cfg local_fwd_lowering=triton
timeout 150 $B --n 8192 --p 50,256 --mix 1g15l --impl ours,cudnn_ls --no-bwd --reps 10 --cfg "" --cfg local_fwd_lowering=triton
# ---- call O5: every GPU test
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
# ---- call O6: shorter sequences, one batch element, a wider window, n=32768 again (strips on by
# default at every n in this call; "" = strips, T = Triton for the local heads)
B="python bench/attention.py --d 64 --check --no-bwd --impl ours"; T=local_fwd_lowering=triton
timeout 150 $B --n 1024,2048,4096 --p 128 --mix 1g15l,local --reps 10 --cfg "" --cfg $T --cfg ""
timeout 100 $B --n 8192 --p 128 --mix 1g15l,local --batch-size 1 --reps 10 --cfg "" --cfg $T --cfg ""
timeout 120 python bench/attention.py --d 64 --check --impl ours --n 16384 --p 256 --mix 2g14l --reps 8 --cfg "" --cfg $T
timeout 150 python bench/attention.py --d 64 --check --no-bwd --impl ours,cudnn_ls --n 32768 --p 128 --mix 1g15l --reps 10 --cfg "" --cfg $T --cfg "" --cfg $T
# ---- call O7: the forward's launches alone, interleaved repeats (O7_launches.py, from scratch/)
timeout 200 python scratch/parts.py
# ---- call O8: n=2048 and 4096 through the benchmark, the two variants alternating three times
timeout 200 python bench/attention.py --d 64 --no-bwd --impl ours --n 2048,4096 --p 128 --mix 1g15l --reps 15 --cfg "" --cfg $T --cfg "" --cfg $T --cfg "" --cfg $T
# ---- call O9: final kernel code (commit a5cfa64): SM count, every GPU test, the 1g15l row
python -c "import jax; d = jax.devices()[0]; print(d.device_kind, 'core_count', getattr(d, 'core_count', None))"
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
timeout 120 python bench/attention.py --d 64 --check --n 8192 --p 128 --mix 1g15l --impl ours,ours_stats,cudnn_ls --reps 10
# ---- calls O10 (hung in the HLO check, O10_..._hung.json) and O11 (after commit 27a30e6), nvidia-h100-x2
timeout 480 python bench/scaling.py --shapes 125m --devices 1,2 --steps 30 --per-run-s 170 --budget-s 420 --out $OUT/O11_scaling_125m_h100x2.json
# ---- call O12: cheaper edge masks (O12_strip_masks.diff applied to a copy, scratch/strip_masks.py), kernels alone
timeout 240 python scratch/ab_masks.py     # = O12_ab_masks.py
# ---- call O13 (nvidia-h100-x1): after the review mend (mosaic_ring.tile_allowed / softmax_carry /
# store_rows shared by the Mosaic kernels), every GPU test and a forward sanity row
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
timeout 100 python bench/attention.py --d 64 --check --no-bwd --n 8192 --p 128 --mix 1g15l,global --impl ours,ours_stats --reps 10
