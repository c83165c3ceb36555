# Run W (2026-11-27): the commands of each call, as run from the repository root on the
# device machine, all on nvidia-h100-x1 (an H100 80GB HBM3, driver 580.159.04; W1-W4 one
# machine, W5 a second, W6 a third). Scripts named scratch/... are the copies in this folder
# (W1_ab.py, W6_ab.py). W1 ran on the spans patch (W1_spans.diff applied to 3c532ca), W6 on
# the one-launch patch (W6_joint_launch.diff applied to 3c532ca); W2-W5 on 3c532ca itself.
# Each call began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# ---- W1 (W1_n8192.txt, W1_ab.txt, W1_tests.txt)
B="python bench/attention.py --d 64 --reps 8 --batch 3 --impl cudnn_ls,ours"
C='--cfg "" --cfg strip_blocks=64 --cfg "" --cfg strip_blocks=64'
eval timeout 110 $B --n 8192 --p 128 --mix 1g15l,local --check $C > $OUT/W1_n8192.txt 2>&1
timeout 100 python scratch/W1_ab.py > $OUT/W1_ab.txt 2>&1
timeout 350 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py \
  tests/test_dispatch.py tests/test_generate.py tests/test_directional.py > $OUT/W1_tests.txt 2>&1

# ---- W2 (W2_p192.txt, W2_kv2.txt, W2_kv8.txt, W2_tests.txt)
B="python bench/attention.py --d 128 --reps 8 --batch 3"
C='--cfg "" --cfg fwd_lowering=mosaic --cfg ""'
eval timeout 100 $B --impl cudnn_ls,ours --n 8192 --p 192 --mix 1g15l,2g14l --check $C > $OUT/W2_p192.txt 2>&1
C='--cfg "" --cfg bwd_lowering=mixed --cfg ""'
eval timeout 45 $B --impl ours --n 8192 --p 128 --mix 1g15l --kv-heads 2 $C > $OUT/W2_kv2.txt 2>&1
eval timeout 45 $B --impl ours --n 8192 --p 128 --mix 1g15l --kv-heads 8 $C > $OUT/W2_kv8.txt 2>&1
timeout 400 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py \
  tests/test_dispatch.py tests/test_generate.py tests/test_directional.py > $OUT/W2_tests.txt 2>&1

# ---- W3 (W3_tests.txt, W3_n32768.txt, W3_n65536.txt, W3_p192.txt)
timeout 230 python -P -m pytest -v -n 4 -m gpu tests/test_split.py tests/test_dispatch.py \
  tests/test_generate.py \
  "tests/test_pallas_gpu.py::test_gpu_mosaic_forward_matches_reference[B1-T2900-H8/2-D64-wNone_50_512_1_None_128_2900_7-t64x128x2xmosaicxmosaicx64x2xNonexFalsex3]" \
  > $OUT/W3_tests.txt 2>&1
B="python bench/attention.py --d 128 --impl ours,cudnn_ls --check"
timeout 140 $B --n 32768 --p 128,512 --mix 1g15l,2g14l --reps 6 --batch 2 > $OUT/W3_n32768.txt 2>&1
timeout 110 $B --n 65536 --batch-size 1 --p 128,512 --mix 2g14l,1g15l --reps 5 --batch 2 > $OUT/W3_n65536.txt 2>&1
timeout 60 $B --n 32768 --p 192 --mix 2g14l,1g15l --reps 6 --batch 2 > $OUT/W3_p192.txt 2>&1

# ---- W4 (W4_n4096_8192.txt)
timeout 230 python bench/attention.py --d 128 --impl ours,cudnn_ls --check --n 4096,8192 --p 128,512 --mix 1g15l,2g14l --reps 8 --batch 3

# ---- W5 (W5_d64.txt, W5_d128_global.txt)
timeout 280 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,global --impl ours,ours_stats,cudnn_ls,cudnn_causal --reps 10 --batch 3 --check
timeout 200 python bench/attention.py --d 128 --n 8192,32768 --mix global --impl ours_stats,cudnn_causal --reps 8 --batch 3 --check

# ---- W6 (W6_tests.txt, W6_ab.txt, W6_n8192.txt, W6_n32768.txt)
timeout 150 python -P -m pytest -v -n 2 -m gpu tests/test_pallas_gpu.py -k "xFalsex2xTrue" > $OUT/W6_tests.txt 2>&1
timeout 150 python scratch/W6_ab.py > $OUT/W6_ab.txt 2>&1
B="python bench/attention.py --d 64 --reps 8 --batch 3 --impl cudnn_ls,ours --p 128 --mix 1g15l,2g14l --check"
C='--cfg "" --cfg local_fwd_lowering=joint --cfg "" --cfg local_fwd_lowering=joint'
eval timeout 100 $B --n 8192 $C > $OUT/W6_n8192.txt 2>&1
eval timeout 120 $B --n 32768 --reps 6 --batch 2 $C > $OUT/W6_n32768.txt 2>&1

# ---- W7 (W7_ratio.txt; a fourth machine, on 3c532ca's kernels)
timeout 300 python scratch/W7_ratio.py

# ---- W8, W8b (W8_ab.txt, W8b_ab.txt; a fifth machine, on W8_joint_interleaved.diff applied
# to 2e06af8: W6's one launch with forward_joint.INTERLEAVE, which W8_ab.py toggles)
timeout 400 python scratch/W8_ab.py
# W8b_ab.py is W8_ab.py with other cases and 21 rounds, made by:
sed 's/cases = \[(8192, 1, False), (8192, 2, False), (32768, 1, False), (32768, 2, False),/cases = [(32768, 1, False), (32768, 1, True), (16384, 1, False), (32768, 1, False),/; s/         (32768, 1, True)\] if gpu/         (65536 \/\/ 2, 2, False)] if gpu/; s/rounds, inner = (15, 10)/rounds, inner = (21, 10)/' scratch/W8_ab.py > scratch/W8b_ab.py
timeout 300 python scratch/W8b_ab.py

# ---- W9 (W9_inference_wide.txt, inference_wide_W9.json; a sixth machine, 3c532ca's kernels)
timeout 430 python bench/inference.py --shapes wide --windows 128 --seq-lens 8192 --batches 1,8 --contexts 8192 --decode-batches 64 --decode-impls pallas_gpu --out $OUT/inference_wide_W9.json
