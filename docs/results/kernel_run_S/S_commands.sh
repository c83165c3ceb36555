# Run S, 2026-11-27, through the device tool, on nvidia-h100-x1 (NVIDIA H100 80GB HBM3, driver
# 580.159.04; S1-S6 one machine, S7-S8 a second one). Each call first ran:
#   ln -sfn ../kernels ls_jax/kernels; ln -sfn ../configs ls_jax/configs
#   export PYTHONPATH=$PWD PYTHONUNBUFFERED=1 XLA_PYTHON_CLIENT_PREALLOCATE=false
# Code: S1 = the directional dispatch before the cuDNN composition's fix (primal rule from
# T=2048); S2 = + kernels/heads.py (composition without gathers) and the rule from T=1024;
# S3-S8 = commits 00c2751 + 2ce2128 + 3ef0f03 (kernels unchanged since faec0f8).
# S_old_comp.py runs bench/attention.py with kernels/cudnn.py of faec0f8 (git show
# faec0f8:kernels/cudnn.py > scratch/old_cudnn.py).
# ---- S1
timeout 200 python -P -m pytest -q -n 3 -m gpu tests/test_dispatch.py tests/test_directional.py tests/test_generate.py tests/test_split.py
timeout 150 python bench/attention.py --d 64,128 --n 1024,2048,4096 --mix global --impl cudnn_causal,ours,auto --no-bwd --reps 15 --check
timeout 220 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,global --impl cudnn_causal,auto,ours,ours_stats,cudnn_ls --reps 10 --batch 3 --check
# ---- S2
timeout 200 python -P -m pytest -q -n 3 -m gpu tests/test_dispatch.py tests/test_split.py tests/test_decode_kernel.py tests/test_generate.py
for i in 1 2; do
  timeout 120 python scratch/old_comp.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,global --impl cudnn_ls,auto --reps 10 --batch 3
  timeout 120 python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,global --impl cudnn_ls,auto,cudnn_causal --reps 10 --batch 3
done
timeout 120 python scratch/old_comp.py --d 128 --n 32768 --p 128 --mix 2g14l --impl cudnn_ls --reps 6 --batch 2
timeout 120 python bench/attention.py --d 128 --n 32768 --p 128 --mix 2g14l --impl cudnn_ls --reps 6 --batch 2
# ---- S3 (S3_d64.txt, S3_d32.txt)
python bench/attention.py --d 64 --n 8192,32768 --p 128 --mix 1g15l,global --impl ours,ours_stats,cudnn_ls,cudnn_causal,auto --reps 10 --batch 3 --check
python bench/attention.py --d 32 --n 8192,32768 --p 50,128 --mix 1g15l,global --impl ours,cudnn_ls,cudnn_causal --reps 8 --batch 3 --check
# ---- S4 (S4_d128.txt)
python bench/attention.py --d 128 --n 4096,8192,32768 --p 128,512 --mix 1g15l,2g14l,global --impl ours,ours_stats,cudnn_ls,cudnn_causal --reps 8 --batch 3 --check
# ---- S5 (S5_n65k.txt)
python bench/attention.py --d 64,128 --n 65536 --batch-size 1 --p 128,512 --mix 1g15l,2g14l,global --impl ours,cudnn_ls,cudnn_causal --reps 6 --batch 2 --check
# ---- S6 (S6_inference_paper.txt, inference_paper_h100_S.json)
timeout 200 python bench/inference.py --shapes paper --out inference_paper_S.json
# ---- S7, S8 (second machine): the wide shape ran out of its time limits before its MHSA rows
timeout 420 python bench/inference.py --shapes wide --out inference_wide_S.json
timeout 230 python bench/inference.py --shapes wide --windows 128 --seq-lens 8192,32768 --batches 1,8 --contexts 8192 --decode-batches 64 --decode-impls pallas_gpu --out inference_wide_S2.json
