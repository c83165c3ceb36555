# Run R, 2026-11-27, through the device tool, every call on nvidia-h100-x1 (NVIDIA H100 80GB HBM3,
# driver 580.159.04). Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
#   export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# scratch/ab_bwdc.py = R_ab_bwdc.py. Code: run Q's Q8_bwd_consumers.diff applied
# (KernelConfig.mosaic_bwd_consumers); R1 with the default still 2, R2-R4 with the new default.
# ---- call R1: the two new GPU cases; A/B (variants in R_ab_bwdc.py; c2 = two consumers with
# 128-row query blocks at D=64, c3q64 = three with 64-row blocks; mixc* = the Mosaic "mixed"
# backward where the default keeps Triton)
timeout 200 python -P -m pytest -q -n 2 -m gpu tests/test_pallas_gpu.py -k "Falsex3"
for c in "g16_d64_8k c2,c3q64" "1g15l_d64_32k c2,c3q64" "1g15l_d64_8k c2,mixc2,mixc3q64" "g16_d64_32k c2,c3q64 5"; do
  timeout 150 python -P scratch/ab_bwdc.py $c
done
# ---- call R2: D=128, a shorter mix, the fused dQ against the new default; then every GPU
# test (its 400 s limit ended pytest after 31 passes with no failure; R3 reran it)
for c in "g16_d128_8k c2,c3q64" "2g14l_d128_32k c2,c3q64" "1g15l_d64_16k c2,c3q64" "g16_d64_8k c3q64,fused,c2"; do
  timeout 130 python -P scratch/ab_bwdc.py $c
done
timeout 400 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
# ---- call R3: every GPU test, the final code (three backward consumers at D <= 64 from 128 tiles)
timeout 570 python -P -m pytest -q -n 4 -m gpu tests/test_pallas_gpu.py tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py
# ---- call R4: the benchmark rows, final code and defaults
timeout 170 python bench/attention.py --d 64 --n 32768 --p 128 --mix 1g15l --impl ours,cudnn_ls --check --reps 8
timeout 250 python bench/attention.py --d 64 --n 8192,32768 --mix global --impl cudnn_causal,ours,ours_stats --check --reps 8
# ---- call R5 (after R4): short all-global sequences and mixes near the threshold, 9 samples
for c in g16_d64_2k g16_d64_4k 2g14l_d64_16k 1g15l_d64_32k_b1; do
  timeout 100 python -P scratch/ab_bwdc.py $c c2,c3q64 9
done
# ---- call R6: the forward's consumer rule at B=1 (default = three consumers under the rule of
# 64 tiles per batch element, against two), forward only
timeout 300 python bench/attention.py --batch-size 1 --d 64,128 --n 16384,32768 --p 128 --mix 1g15l,2g14l --impl ours --no-bwd --reps 15 --cfg "" --cfg mosaic_consumers=2 --cfg ""
# ---- call R7: the final rules (programs for the whole call): R6's rows with the defaults; the
# GPU tests outside the Mosaic cases (those ran in R3 on the same kernel code)
timeout 150 python bench/attention.py --batch-size 1 --d 64,128 --n 16384,32768 --p 128 --mix 1g15l,2g14l --impl ours --no-bwd --reps 15
timeout 330 python -P -m pytest -q -n 4 -m gpu tests/test_split.py tests/test_dispatch.py tests/test_generate.py tests/test_decode_kernel.py tests/test_pallas_gpu.py -k "not mosaic_forward_matches"
# ---- call R8: the local heads on the Mosaic backward (grid, and with the fused dQ) against Triton
timeout 420 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,local --impl ours --reps 8 --cfg "" --cfg bwd_lowering=mosaic --cfg bwd_lowering=mosaic,mosaic_fused_dq=true --cfg bwd_lowering=mixed,mosaic_fused_dq=true --cfg ""
