# Run T (2026-11-27): the commands of each call, as run from the repository root on the
# device machine (T1-T3 on nvidia-h100-x1: an H100 80GB HBM3, driver 580.159.04; T4-T5 on an
# NVIDIA H200: the call asked for no kind and got one). Each call began with:
ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false

# T1 (H100): the local heads alone at D=128, Triton tiles and the Mosaic kernels; then
# "split" against ours at long n (T1_local_d128.txt, T1_split32k.txt, T1_split65k.txt)
B="python bench/attention.py --impl ours --reps 8 --batch 3 --mix local --d 128 --n 8192"
timeout 330 $B --p 128,512 --cfg "" --cfg fwd_lowering=mosaic,bwd_lowering=mosaic \
  --cfg bwd_lowering=mosaic --cfg dq_block_k=64 --cfg dkdv_block_q=64 --cfg bwd_num_stages=2 \
  --cfg bwd_num_warps=8,dq_block_q=128,dq_block_k=64,dkdv_block_q=64,dkdv_block_k=128 \
  --cfg fwd_block_q=128,fwd_num_warps=8 --cfg fwd_block_k=32
timeout 200 python bench/attention.py --d 128 --n 32768 --p 128,512 --mix 2g14l --impl ours,split,cudnn_ls --reps 6 --batch 2
timeout 100 python bench/attention.py --d 128 --n 65536 --batch-size 1 --p 512 --mix 2g14l --impl ours,split,cudnn_ls --reps 6 --batch 2

# T2-T3 (H100): LS mixes at D=128, the old default against the Mosaic backward for every
# head, and against every head on Mosaic (T2_b.txt: n=32768; T3_a.txt: n=4096-8192, JSON
# rows, cut off by its timeout after 26 rows; T3_c1/c2.txt: n=65536, B=1). T2's n=4096-8192
# and n=65536 commands ran out of their timeouts before printing (their output was filtered
# to the final table): T3 repeats them with fewer rows.
C='--cfg "" --cfg bwd_lowering=mosaic --cfg fwd_lowering=mosaic,bwd_lowering=mosaic'
eval timeout 180 python bench/attention.py --d 128 --n 32768 --p 128,512 --mix 1g15l,2g14l --impl ours,cudnn_ls --reps 6 --batch 2 $C
eval timeout 230 python bench/attention.py --d 128 --n 4096,8192 --p 128,512 --mix 1g15l,2g14l --impl ours,cudnn_ls --reps 6 --batch 2 $C
eval timeout 60 python bench/attention.py --d 128 --n 65536 --batch-size 1 --p 512 --mix 2g14l --impl ours,cudnn_ls --reps 5 --batch 2 $C
eval timeout 60 python bench/attention.py --d 128 --n 65536 --batch-size 1 --p 128 --mix 1g15l --impl ours,cudnn_ls --reps 5 --batch 2 $C

# T4 (H200): every head on Mosaic (the first version of the rule, "") against the old
# default; then every GPU test (T4_a.txt, T4_b.txt, T4_tests.txt)
C='--cfg "" --cfg fwd_lowering=mixed,bwd_lowering=mixed'
eval timeout 130 python bench/attention.py --d 128 --n 4096,8192 --p 128,512 --mix 1g15l --impl ours,cudnn_ls --reps 8 --batch 3 $C
eval timeout 50 python bench/attention.py --d 128 --n 65536 --batch-size 1 --p 512 --mix 2g14l --impl ours,cudnn_ls --reps 5 --batch 2 --check $C
timeout 360 python -P -m pytest -v -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_directional.py

# T5 (H200): p=128, the forward's three options ("" = every head on Mosaic, run twice)
timeout 170 python bench/attention.py --d 128 --n 8192,4096 --p 128 --mix 1g15l --impl ours --reps 10 --batch 3 --cfg "" --cfg fwd_lowering=mixed --cfg fwd_lowering=mixed,bwd_lowering=mixed --cfg ""

# T6 (H200): the final rule's default-config D=128 GPU cases (output in docs/performance.md)
timeout 170 python -P -m pytest -v -n 2 -m gpu tests/test_pallas_gpu.py -k "test_gpu_bf16_matches_reference and D128"
