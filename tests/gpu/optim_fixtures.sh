#!/bin/bash
# The GPU-only optimizer fixtures (FusedLamb and fp16 need CUDA), made on a lent one-GPU host (torch 2.11 + CUDA,
# DeepSpeed 0.19.8 from .whl/): run from a checkout holding tests/fixtures/generate_optim.py, with OUT set.
#     bash tests/gpu/optim_fixtures.sh          # writes $OUT/optim_gpu.tgz (optim/<name>/...) and one log per fixture
# Then, here: tar -xzf optim_gpu.tgz -C tests/fixtures; python tests/gpu/optim_fixtures.sh's truth.pt (if the host
# had no safetensors) is converted by: python -c "import torch,safetensors.torch as s;
#     s.save_file(torch.load('truth.pt'), 'truth.safetensors')" in each fixture folder.
set -u
export NCCL_NVLS_ENABLE=0
# the host's TORCH_CUDA_ARCH_LIST says "9.0a", which DeepSpeed 0.19.8's op builder cannot parse (FusedLamb's JIT build)
export TORCH_CUDA_ARCH_LIST=9.0
LAUNCH=$(command -v deepspeed || echo "python3 -m deepspeed.launcher.runner")
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader > "$OUT/device.txt" 2>&1
python3 -c "import torch, deepspeed; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)" >> "$OUT/device.txt" 2>&1
port=29481
for n in ${@:-lamb_s2_fp16_w1 sgd_s1_fp16_w1}; do
  port=$((port + 1))
  $LAUNCH --num_gpus 1 --master_port $port tests/fixtures/generate_optim.py --name "$n" --device cuda \
    --out "$OUT/optim" > "$OUT/$n.log" 2>&1
  echo "$n rc=$?" >> "$OUT/device.txt"
done
tar -czf "$OUT/optim_gpu.tgz" -C "$OUT" optim
