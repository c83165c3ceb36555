# Run N, 2026-11-26, through the device tool: N1-N5 and N7-N9 on nvidia-h100-x1 (H100 80GB HBM3),
# N6 on nvidia-h100-x2 (came as two H200s). Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs; export PYTHONPATH=$PWD
# ---- call N1: bash scratch/run1.sh
set -x
B="python bench/attention.py --d 64 --p 128 --impl ours,cudnn_ls --no-bwd --check --reps 10"
timeout 170 $B --n 8192 --mix 1g15l --cfg "" --cfg fwd_lowering=mosaic --cfg fwd_lowering=mosaic,mosaic_programs=132 --cfg mosaic_programs=132 --cfg "" 2>&1 | grep -v "^\s*$" > $OUT/e1_n8192.txt; tail -12 $OUT/e1_n8192.txt
timeout 170 $B --n 32768 --mix 1g15l --cfg "" --cfg fwd_lowering=mosaic,mosaic_programs=132 --cfg fwd_lowering=mosaic,mosaic_programs=132,mosaic_consumers=2 --cfg fwd_lowering=mosaic,mosaic_consumers=2 2>&1 | grep -v "^\s*$" > $OUT/e1_n32768.txt; tail -10 $OUT/e1_n32768.txt
timeout 150 $B --n 8192 --mix local --impl ours --cfg "" --cfg fwd_lowering=mosaic,mosaic_block_k=128 --cfg fwd_lowering=mosaic,mosaic_block_k=128,mosaic_programs=132 2>&1 | grep -v "^\s*$" > $OUT/e1_local.txt; tail -8 $OUT/e1_local.txt
# ---- call N2: bash scratch/run2.sh
B="python bench/attention.py --d 64 --p 128 --impl ours,cudnn_ls --no-bwd --check --reps 10"
P=fwd_lowering=mosaic,mosaic_programs=132
timeout 150 $B --n 8192 --mix local --impl ours --cfg "" --cfg $P,mosaic_block_k=128 --cfg $P,mosaic_block_k=128,mosaic_consumers=3 --cfg $P,mosaic_block_k=64 2>&1 | grep "^|" > $OUT/e2_local.txt
timeout 170 $B --n 8192 --mix 1g15l --cfg "" --cfg $P --cfg $P,mosaic_consumers=3 --cfg $P,mosaic_block_k=64 --cfg "" 2>&1 | grep "^|" > $OUT/e2_n8192.txt
timeout 170 $B --n 32768 --mix 1g15l --cfg "" --cfg $P --cfg $P,mosaic_consumers=2 --cfg "" 2>&1 | grep "^|" > $OUT/e2_n32768.txt
XLA_PYTHON_CLIENT_PREALLOCATE=false timeout 250 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py -k mosaic_forward 2>&1 | tail -4 > $OUT/e2_gpu_tests.txt
cat $OUT/*.txt
# ---- call N3: bash scratch/run3.sh
echo "| D | n | heads | consumers | old grid ms | new grid ms | persistent ms |" > $OUT/e3_kernels.txt
timeout 300 python scratch/ab_kernel.py 2>&1 | grep -v "^\s*$" | grep "^|\|MISMATCH\|Error\|error" >> $OUT/e3_kernels.txt
timeout 200 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl ours_stats,cudnn_ls --no-bwd --reps 8 --cfg "" --cfg mosaic_programs=132 --cfg "" 2>&1 | grep "^|" > $OUT/e3_d128.txt
cat $OUT/*.txt
# ---- call N4: bash scratch/run4.sh
echo "| D | n | heads | consumers | old grid ms | new grid ms | persistent ms |" > $OUT/e4_kernels.txt
timeout 330 python scratch/ab_kernel.py 2>&1 | grep -v "^\s*$" | grep "^|\|MISMATCH\|Error\|error" >> $OUT/e4_kernels.txt
cat $OUT/e4_kernels.txt
timeout 200 python bench/attention.py --d 64 --p 128 --n 8192,32768 --mix 1g15l --impl ours,cudnn_ls --no-bwd --reps 10 --cfg "" --cfg mosaic_programs=132 --cfg fwd_lowering=mosaic,mosaic_programs=132 --cfg "" 2>&1 | grep "^|" > $OUT/e4_1g15l.txt
cat $OUT/e4_1g15l.txt
# ---- call N5: bash scratch/run5.sh
timeout 330 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl ours_stats,cudnn_causal --no-bwd --reps 8 --check --cfg "" --cfg mosaic_stages=3 --cfg "" --cfg mosaic_stages=3 2>&1 | grep "^|\|rror" > $OUT/e5_d128_stages.txt
cat $OUT/e5_d128_stages.txt
timeout 150 python bench/attention.py --d 64 --n 8192 --mix global --impl ours_stats,cudnn_causal --no-bwd --reps 10 --cfg "" --cfg mosaic_stages=3 --cfg "" --cfg mosaic_stages=3 2>&1 | grep "^|\|rror" > $OUT/e5_d64_stages.txt
cat $OUT/e5_d64_stages.txt
# ---- call N6: bash scratch/run6.sh
python - <<'PY'
s = open("bench/scaling.py").read()
s = s.replace('SHAPES = {\n', 'SHAPES = {\n    "125m_2g": dict(model=dict(vocab_size=50304, n_layer=12, d_model=768, n_head=12, head_dim=64, n_global_heads=2, window=128, max_seq_len=8192, compute_dtype="bfloat16"), seq_len=8192, per_device_batch=2),\n', 1)
open("bench/scaling3.py", "w").write(s)  # beside bench/hardware.py, which it imports
PY
timeout 560 python bench/scaling3.py --shapes 125m_2g --devices 1,2 --steps 30 --per-run-s 200 --budget-s 500 --out $OUT/scaling_125m_2g_h100x2.json 2>&1 | tail -25
# ---- call N7: bash scratch/run7.sh
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats"
timeout 250 ncu --clock-control none -k regex:ls_attention_fwd -c 1 $S -f -o $OUT/local_fwd python scratch/ncu_local.py > $OUT/ncu_log.txt 2>&1
timeout 60 ncu --import $OUT/local_fwd.ncu-rep --print-summary none > $OUT/local_fwd_details.txt 2>&1
grep -i "Duration\|Throughput\|Occupancy\|Registers\|Shared Memory\|Block Size\|Grid Size\|Waves\|Stall\|Eligible\|Issued\|Hit Rate\|Active Warps\|No Eligible" $OUT/local_fwd_details.txt | head -70
tail -3 $OUT/ncu_log.txt
# ---- calls N8-N9 (nvidia-h100-x1): the strip prototype, from the checkout with
# scratch/forward_strip.py = N8_forward_strip.py and scratch/bench_strip.py = N8_bench_strip.py
# (N8 timed strips of 8, 16 and 32 blocks with two consumers; N9 the variants now in the script)
timeout 300 python scratch/bench_strip.py
