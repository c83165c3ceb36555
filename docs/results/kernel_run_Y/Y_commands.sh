# Run Y (2026-11-27): the commands of each call, as run from the repository root on the device
# machine, all on nvidia-h100-x1 (an H100 80GB HBM3, driver 580.159.04; a fresh machine each
# call). Scripts named scratch/... are the copies in this folder. The kernels: the package at
# the commit that follows run Y with Y_strip_backward.diff applied (Y3-Y5); Y1-Y2 ran the first
# version, the same without walk_strip's `own_first` (the consumers released streamed blocks
# only after their own block; see kernel-notes.md, run Y). Each call began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# ---- Y1 (Y1_hung.txt): the first version; hung after the first row, the call ran out its time
# (Y1 ran the script with 15 rounds, a fourth check variant "triton+strip" and a p=50 f+b case;
# the copy here is Y3's)
timeout 540 python scratch/Y1_strip_bwd.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/Y1.txt

# ---- Y2 (Y2_bisect.txt): each piece in its own process, 40 s each
CASE_TIMEOUT=40 timeout 480 python scratch/Y2_bisect.py all 2>&1 | tee $OUT/Y2.txt

# ---- Y3 (Y3.txt): the fixed kernels: gradients, launches alone, f+b
timeout 570 python scratch/Y1_strip_bwd.py 2>&1 | grep -v "^WARNING\|^I0000\|^W0000" | tee $OUT/Y3.txt

# ---- Y4 (Y4.txt, Y4_ptxas_raw.txt): ptxas of both strip kernels, dK/dV with two consumers
MOSAIC_GPU_DUMP_PTXAS=1 timeout 200 python scratch/Y4_dkdv_probe.py > $OUT/Y4_raw.txt 2>&1
grep -i "===\|spill\|Used [0-9]* registers\|^|" $OUT/Y4_raw.txt | tee $OUT/Y4.txt

# ---- Y5 (Y5.txt): dK/dV on two consumers, dQ on two or three; f+b
timeout 320 python scratch/Y5_consumers.py 2>&1 | grep "^|" | tee $OUT/Y5.txt
