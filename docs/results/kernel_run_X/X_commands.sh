# Run X (2026-11-27): the commands of each call, as run from the repository root on the device
# machine, all on nvidia-h100-x1 (an H100 80GB HBM3, driver 580.159.04, ncu 2025.3.1; nine
# machines: X1, X2, X3, X4, X5-X6, X7, X8, X9-X10, X11). Scripts named scratch/... are the copies in
# this folder. The kernels are e6f83f7's, with X_whole_band_and_probes.diff applied for X1-X8
# (X1 ran a first version of the whole band, with every block masked from its position; X5-X8
# the diff as kept: masks fixed at trace time where the band starts inside the sequence, the
# middle block unmasked, and the experiment switches EARLY_RELEASE, EXTRA_STAGES, NO_COMPUTE,
# Q_LOADS, O_STORES); X9-X10 on e6f83f7 itself. Each call began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# ---- X1 and X5 (X1_*.txt, X5_*.txt): ptxas registers and spills, the A/B, the benchmark
MOSAIC_GPU_DUMP_PTXAS=1 timeout 120 python scratch/X_ptxas.py > $OUT/X1_ptxas_raw.txt 2>&1
timeout 250 python scratch/X1_ab.py | tee $OUT/X1_ab.txt
B="python bench/attention.py --d 64 --reps 8 --batch 3 --impl cudnn_ls,ours --p 128 --mix 1g15l --check"
C='--cfg "" --cfg strip_whole_band=true --cfg "" --cfg strip_whole_band=true'
eval timeout 150 $B --n 8192 $C > $OUT/X1_n8192.txt 2>&1
timeout 100 python scratch/X3_capacity.py | tee $OUT/X5_capacity.txt   # X5 only

# ---- X2 (X2_ncu_details.txt): ncu of the 1g15l forward's two launches, both strip versions
S="--section SpeedOfLight --section Occupancy --section LaunchStats --section WarpStateStats --section MemoryWorkloadAnalysis --section SchedulerStats --section ComputeWorkloadAnalysis"
timeout 300 ncu --clock-control none -k regex:entry -c 4 $S -f -o $OUT/X2 python scratch/X2_ncu.py
timeout 60 ncu --import $OUT/X2.ncu-rep --print-summary none > $OUT/X2_ncu_details.txt

# ---- X3 (X3_capacity.txt, X3_kernels_details.txt): one program's pace at 8-120 programs;
# every kernel of one forward call
timeout 200 python scratch/X3_capacity.py | tee $OUT/X3_capacity.txt
timeout 200 ncu --clock-control none -c 40 --section SpeedOfLight -f -o $OUT/X3_kernels python scratch/X3_kernels.py
timeout 60 ncu --import $OUT/X3_kernels.ncu-rep --print-summary none > $OUT/X3_kernels_details.txt

# ---- X4 (before the static masks) and X6 (after): per-instruction samples of the strip launch
S="--section WarpStateStats --section InstructionStats --section SourceCounters --section SpeedOfLight --section ComputeWorkloadAnalysis"
timeout 300 ncu --clock-control none -k regex:entry -c 2 $S --import-source no -f -o $OUT/X6 python scratch/X4_ncu_strip.py
timeout 60 ncu --import $OUT/X6.ncu-rep --print-summary none --print-details all > $OUT/X6_details.txt
timeout 90 ncu --import $OUT/X6.ncu-rep --page source --csv --print-source sass > $OUT/X6_sass.csv
# kept here: the summaries made from them on the CPU
grep -E "entry_mosaic|Duration|Executed Instructions  |Stall (Long|Wait|Not Sel|Barrier|Short|Math)|Warp Cycles Per Issued|Pipe (Alu|Fma |Tensor Cycles)|Inst Executed Pipe Xu|DRAM Throughput|Issue Slots" X6_details.txt > X6_ncu_summary.txt
python3 X_sass_classes.py X6_sass.csv > X6_sass_classes.txt

# ---- X7 (X7_ab.txt): early release and two more ring slots
timeout 400 python scratch/X7_ab.py

# ---- X8 (X8_move.txt): the strips without their arithmetic, loads or stores
timeout 200 python scratch/X8_move.py

# ---- X9 (X9_copy.txt, X9_tests.txt): a plain XLA stream of the same bytes; the GPU suite on
# e6f83f7
timeout 60 python scratch/X9_copy.py
timeout 480 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py \
  tests/test_dispatch.py tests/test_generate.py tests/test_directional.py > $OUT/X9_tests.txt 2>&1

# ---- X10 (X10_ncu_stream.txt): that stream's kernel under ncu (an earlier try with -c 12 and
# no kernel filter caught only the inputs' random-number kernels)
timeout 200 ncu --clock-control none --section SpeedOfLight -k regex:"add|reduce" -c 4 -f -o $OUT/X10 python scratch/X9_copy.py

# ---- X11 (X11_ab.txt; a ninth machine, on X11_load_ahead_out_tiles.diff applied to e6f83f7:
# forward_strip.Q_SLOTS / OUT_SLOTS, which X11_ab.py toggles)
timeout 300 python scratch/X11_ab.py
