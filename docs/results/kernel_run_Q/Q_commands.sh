# Run Q, 2026-11-27, through the device tool. Q1 and Q3-Q7 on nvidia-h100-x1 (NVIDIA H100 80GB
# HBM3, driver 580.159.04); Q2 asked for the same kind and ran on an NVIDIA H200. Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs; export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
# scratch/ab_strip.py = Q1_ab_strip.py, scratch/ncu_strip.py = Q2_ncu_strip.py, scratch/ptxas_c3.py =
# Q3_ptxas_c3.py, scratch/ab_min.py = Q4_ab_min.py, scratch/ptxas_final.py = Q5_ptxas_final.py; Q1-Q2
# ran with kernels/pallas_gpu/backward_strip.py = Q1_backward_strip.py and Q1_strip_backward_wiring.diff applied
# ---- call Q1: the fused strip backward (Triton) against the two Triton kernels
timeout 200 python scratch/ab_strip.py kern 16l_8k,16l_32k 6 tri,s16w4s2,s16w8s2,s32w4s2,s8w4s2,s16w4s3
timeout 150 python scratch/ab_strip.py fb 1g15l_8k,1g15l_32k 6 default,local_bwd_lowering=strip,local_bwd_lowering=strip+bwd_lowering=mixed
# ---- call Q2 (H200): ncu of the three kernels
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
timeout 300 ncu --clock-control none -k regex:ls_attention_bwd -c 6 $S -f -o $OUT/strip python scratch/ncu_strip.py > $OUT/ncu_log.txt 2>&1
timeout 60 ncu --import $OUT/strip.ncu-rep --print-summary none > $OUT/strip_details.txt 2>&1     # Q2_ncu_details.txt
# ---- call Q3: three consumers at D=128 (the code before this run: row minimum before the exponentials)
MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python scratch/ptxas_c3.py 2>&1 | grep -i "===\|spill\|Used" | head -20
timeout 360 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl cudnn_causal,ours_stats --no-bwd --reps 15 --cfg "" --cfg mosaic_consumers=3,mosaic_block_k=64 --cfg mosaic_consumers=3 --cfg "" --cfg mosaic_consumers=3,mosaic_block_k=64
# ---- call Q4: where the row minimum goes; all-global and LS-mix rows
timeout 150 python scratch/ab_min.py
timeout 300 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl cudnn_causal,ours,ours_stats --check --reps 10 --cfg "" --cfg mosaic_consumers=3
timeout 300 python bench/attention.py --d 128 --n 4096,16384,32768 --p 128,512 --mix 1g15l,2g14l --impl cudnn_ls,ours --no-bwd --reps 8 --cfg "" --cfg mosaic_consumers=3
# ---- call Q5: the final code (three consumers up to D=128 by default, the minimum after the exponentials there)
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 400 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
timeout 130 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl cudnn_causal,ours,ours_stats --check --reps 8
MOSAIC_GPU_DUMP_PTXAS=1 timeout 45 python scratch/ptxas_final.py 2>&1 | grep -i "===\|spill" | head -12
# ---- call Q6: the two new GPU cases
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 330 python -P -m pytest -v -n 2 -m gpu tests/test_pallas_gpu.py -k "D128 and 64x3"
# ---- call Q7: every GPU test
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 560 python -P -m pytest -q -n 4 -m gpu --durations=6 tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
# ---- call Q8: the Mosaic backward with three consumers (a patched copy of the module), f+b A/B and ptxas
MOSAIC_GPU_DUMP_PTXAS=1 timeout 220 python scratch/ab_bwd3.py g16_d64_8k,1g15l_d64_32k 2>&1 | grep -i "spill\|c3q64\|f+b\|Error\|error" | sort | uniq -c | sort -rn | head -30
