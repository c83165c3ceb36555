# Run U (2026-11-27): the commands of each call, as run from the repository root on the
# device machine, all on nvidia-h100-x1 (an H100 80GB HBM3, driver 580.159.04). Each call
# began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# U1: the D=128 grid on run T's defaults, one call, against the cuDNN composition, --check
# (U1_a-c.txt); GQA mixes, 4 kv heads: the default (then the Hopper backward) against
# bwd_lowering=mixed (the Triton backward with GQA, the rule before run T) (U1_d.txt)
B="python bench/attention.py --d 128 --impl ours,cudnn_ls --check"
timeout 190 $B --n 4096,8192 --p 128,512 --mix 1g15l,2g14l --reps 8 --batch 3
timeout 140 $B --n 32768 --p 128,512 --mix 1g15l,2g14l --reps 6 --batch 2
timeout 110 $B --n 65536 --batch-size 1 --p 128,512 --mix 2g14l,1g15l --reps 5 --batch 2
timeout 110 python bench/attention.py --d 128 --impl cudnn_ls,ours --n 8192 --p 512,128 --mix 1g15l --kv-heads 4 --reps 8 --batch 3 --cfg "" --cfg bwd_lowering=mixed

# U2 (run T's defaults): (a) three forward consumers and 128-key dQ blocks for the two rows
# under 1.5x (U2_a1/a2.txt; "" twice); (b) GQA p=128/256, the Hopper against the Triton
# backward, each twice (U2_b.txt, cut by its timeout after 12 rows: the ptxas "error code 15"
# in it is the compiler killed by that SIGTERM; U2_b2.txt); (c) p=256, the Hopper forward for
# the local heads against Triton (U2_c.txt)
B="python bench/attention.py --d 128 --reps 8 --batch 3"
C='--cfg "" --cfg mosaic_consumers=3 --cfg mosaic_dq_block_k=128 --cfg mosaic_consumers=3,mosaic_dq_block_k=128 --cfg ""'
eval timeout 140 $B --impl cudnn_ls,ours --n 8192 --p 512 --mix 1g15l $C
eval timeout 100 $B --impl cudnn_ls,ours --n 4096 --p 512 --mix 2g14l $C
C='--cfg "" --cfg bwd_lowering=mixed --cfg "" --cfg bwd_lowering=mixed'
eval timeout 130 $B --impl ours --kv-heads 4 --n 8192 --p 128,256 --mix 1g15l,2g14l $C
eval timeout 50 $B --impl ours --kv-heads 4 --n 4096 --p 128 --mix 1g15l $C
C='--cfg "" --cfg fwd_lowering=mosaic'
eval timeout 110 $B --impl ours --n 4096,8192 --p 256 --mix 1g15l,2g14l $C

# U3: the new rule ("", with the every-head three-consumer threshold then at 256 programs)
# against the previous default, expressed as overrides (U3_a-d.txt); then the D=128 GPU tests
# (U3_tests.txt: 9 of 11 passed before the timeout cut the last two)
C='--cfg "" --cfg fwd_lowering=mixed,mosaic_consumers=2 --cfg fwd_lowering=mixed,mosaic_consumers=3'
eval timeout 150 $B --impl cudnn_ls,ours --n 4096,8192 --p 256 --mix 1g15l,2g14l $C
eval timeout 80 $B --impl cudnn_ls,ours --n 32768 --p 256 --mix 1g15l,2g14l --reps 6 --batch 2 --cfg '""' --cfg fwd_lowering=mixed
C='--cfg "" --cfg mosaic_consumers=2 --cfg ""'
eval timeout 50 $B --impl ours --n 8192 --p 512 --mix local $C
eval timeout 40 $B --impl ours --n 4096 --batch-size 1 --p 512 --mix 1g15l $C
C='--cfg "" --cfg fwd_lowering=mixed,mosaic_consumers=2'
eval timeout 60 $B --impl cudnn_ls,ours --kv-heads 4 --n 8192 --p 256,512 --mix 1g15l $C
timeout 170 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py -k "D128"

# U4: the final rule's D=128 GPU cases and the two U3 did not reach (U4_tests.txt)
timeout 300 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py -k "test_gpu_bf16_matches_reference and D128 or T4000-H8/2-D128 or T2048-H4/4-D128-wNone_None_300"

# U5: the final code, the p=512 rows of the ">= 1.5x" target, ours twice (U5.txt)
timeout 190 python bench/attention.py --d 128 --n 4096,8192 --p 512 --mix 1g15l,2g14l --impl cudnn_ls,ours --reps 8 --batch 3 --check --cfg "" --cfg ""
