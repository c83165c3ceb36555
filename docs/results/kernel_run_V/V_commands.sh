# Run V (2026-11-27): the commands of each call, as run from the repository root on the
# device machine, all on nvidia-h100-x1 (an H100 80GB HBM3, driver 580.159.04; V1-V2 one
# machine, V3 a second, V4-V5 a third). Each call began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# scratch/bench_bwd.py (untracked; its V4 version is V4_bench_bwd.py here) ran bench/attention.py with one patch whose knob was a
# config field unused at D=128: in V1, --cfg strip_blocks=3 gave the Hopper backward kernels
# three ring stages (static["stages"] in backward_mosaic._static); in V4, --cfg
# strip_blocks=1 called dkdv_call_mosaic(..., sum_groups=False) (one program per query head,
# XLA's group sum after it: run U's kernel)

# V1 (code of 0f99ac0: delta from the Hopper dQ kernel): "" against delta_in_kernel=false
# (the XLA pass, the code before) and three backward stages (V1_a-e.txt)
B="python scratch/bench_bwd.py --reps 8 --batch 3"
C='--cfg "" --cfg delta_in_kernel=false --cfg strip_blocks=3 --cfg ""'
eval timeout 170 $B --check --d 128 --impl cudnn_ls,ours --n 8192 --p 512 --mix 1g15l,2g14l $C
eval timeout 110 $B --d 128 --impl cudnn_ls,ours --n 4096 --p 512,128 --mix 1g15l $C
C='--cfg "" --cfg delta_in_kernel=false --cfg ""'
eval timeout 70 $B --d 128 --impl ours --kv-heads 4 --n 8192 --p 512 --mix 1g15l $C
eval timeout 80 $B --d 64 --impl cudnn_causal,ours --n 8192 --mix global $C
eval timeout 90 $B --d 64 --impl cudnn_ls,ours --n 32768 --p 128 --mix 1g15l --reps 6 --batch 2 $C

# V2 (same code): all global D=128, 64-key dQ blocks (room for delta in the kernel) against
# the default; GQA p=128, the Hopper backward against the default (Triton); the 1.5x rows
# (V2_a-d.txt; V2_c was cut by its timeout after 14 rows)
B="python bench/attention.py --d 128"
C='--cfg "" --cfg mosaic_dq_block_k=0 --cfg "" --cfg mosaic_dq_block_k=0'
eval timeout 100 $B --impl cudnn_causal,ours --n 8192 --mix global --reps 8 --batch 3 $C
eval timeout 120 $B --impl cudnn_causal,ours --n 32768 --mix global --reps 4 --batch 1 $C
C='--cfg "" --cfg bwd_lowering=mosaic --cfg "" --cfg bwd_lowering=mosaic'
eval timeout 110 $B --impl ours --kv-heads 4 --n 8192,4096 --p 128 --mix 1g15l,2g14l --reps 8 --batch 3 $C
eval timeout 150 $B --impl cudnn_ls,ours --check --n 8192,4096 --p 512 --mix 1g15l,2g14l --reps 8 --batch 3 --cfg '""' --cfg '""'

# V3 (code of e0beec7: run U's GQA rule dropped, later reverted): every GPU test; GQA p=128,
# the default (then the Hopper backward) against bwd_lowering=mixed (Triton) (V3_tests.txt,
# V3_a.txt)
timeout 440 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_directional.py
C='--cfg "" --cfg bwd_lowering=mixed --cfg "" --cfg bwd_lowering=mixed'
eval timeout 100 python bench/attention.py --d 128 --impl ours --kv-heads 4 --n 8192 --p 128 --mix 1g15l,local --reps 8 --batch 3 $C

# V4 (code of 5bcf432: the dK/dV kernel sums each GQA group; run U's rule in place, so ""
# is Triton at p=128): the GPU cases; GQA p=128 against bwd_lowering=mosaic; p=512 against
# the per-query-head kernel (V4_tests.txt, V4_a-b.txt)
timeout 200 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py -k "test_gpu_bf16_matches_reference"
B="python scratch/bench_bwd.py --d 128 --kv-heads 4 --n 8192 --reps 8 --batch 3"
C='--cfg "" --cfg bwd_lowering=mosaic --cfg "" --cfg bwd_lowering=mosaic'
eval timeout 150 $B --impl ours --p 128 --mix 1g15l,local,2g14l $C
C='--cfg "" --cfg strip_blocks=1 --cfg "" --cfg strip_blocks=1'
eval timeout 70 $B --impl ours --check --p 512 --mix 1g15l $C

# V5 (the final rule, 7b5020e): the D=128 GPU cases (V5_tests.txt)
timeout 200 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py -k "test_gpu_bf16_matches_reference and D128"
