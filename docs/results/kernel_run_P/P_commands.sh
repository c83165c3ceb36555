# Run P, 2026-11-27, through the device tool. P1-P3 and P5-P7 on nvidia-h100-x1 (NVIDIA H100 80GB
# HBM3, driver 580.159.04); P4 asked for nvidia-h100-x1 and ran on an NVIDIA H200. Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs; export PYTHONPATH=$PWD
# scratch/ab_fused.py = P_ab_fused.py (P1 ran its first version: variants sep / fused only, the
# fused kernel on the config's 128-row query blocks, and a rerun of fused checked for bit-identity)
# ---- call P1: ptxas of the fused kernels, then the first A/B
MOSAIC_GPU_DUMP_PTXAS=1 timeout 150 python -c "<grad of a D=64 and a D=128 call with mosaic_fused_dq=True, bwd_lowering='mosaic', T=2048>"
timeout 330 python scratch/ab_fused.py g16_d64_8k,1g15l_d64_8k,1g15l_d64_32k,g16_d128_8k,2g14l_d128_16k 8
# ---- calls P2-P3: where the time goes (P2_ab_modes.py with the switch of P2_modes.diff; P2 ran
# the variants sep, full, noreduce, nostore on 128-row blocks, P3 the file as it is here)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 300 python scratch/ab_modes.py 64                       # P2
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python scratch/ab_modes.py 64 64                    # P3
for r in 1 2; do timeout 150 python bench/attention.py --d 128 --n 8192,32768 --p 128 --mix global --impl ours_stats,cudnn_ls,ours --no-bwd --reps 20; done
# ---- call P4 (H200): the final kernel (64-row query blocks, two outgoing tiles) across shapes
timeout 420 python scratch/ab_fused.py g16_d64_8k,1g15l_d64_8k,1g15l_d64_32k,2g14l_d64_16k,g16_d64_32k 6 sep,fused,fused1slot
# ---- call P5: every GPU test, then the H100 A/B
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 330 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
timeout 240 python scratch/ab_fused.py g16_d64_8k,g16_d128_8k,g16_d64_32k 6 sep,fused
# ---- calls P6-P7: through the benchmark (final code)
timeout 330 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix global --impl ours,cudnn_ls --check --reps 10 --cfg "" --cfg mosaic_fused_dq=true      # P6
timeout 300 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix global --impl ours,cudnn_causal --check --reps 10 --cfg "" --cfg mosaic_fused_dq=true  # P7
# ---- call P8: final code (dk, dv and a mix's dQ buffer from lax.empty, not zeros)
timeout 230 python scratch/ab_fused.py 1g15l_d64_32k,2g14l_d64_16k,g16_d64_8k 6 sep,fused
# ---- call P9: the three fused GPU cases on the final code (device memory poisoned first, as every GPU case)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 220 python -P -m pytest -q -n 3 -m gpu tests/test_pallas_gpu.py -k "True"
