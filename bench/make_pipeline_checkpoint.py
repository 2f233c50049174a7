"""Write the checkpoint of bench/pipeline.py: a ``PipelineModule`` of ``--layers`` Linear(hidden, hidden) layers on
2 stages (DeepSpeed's default partition_method, ``parameters``), ZeRO-1 fp32 Adam, one step. Run on 2 CPU ranks:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29531 bench/make_pipeline_checkpoint.py \
        --out bench/out/pp2 --hidden 8192 --layers 15

``--hidden 8192 --layers 15`` is 1.007B parameters (16.1 GB of checkpoint: 4 GB of layer files, 12 GB of fp32
masters and Adam moments).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=256)
p.add_argument("--layers", type=int, default=6)
p.add_argument("--stages", type=int, default=2)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
args = p.parse_args()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import deepspeed
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, PipelineModule
from ds_launch import gloo_only

gloo_only()
deepspeed.init_distributed("gloo")
t0 = time.time()
torch.manual_seed(1234)
model = PipelineModule(layers=[LayerSpec(nn.Linear, args.hidden, args.hidden) for _ in range(args.layers)],
                       num_stages=args.stages, loss_fn=lambda out, tgt: F.mse_loss(out, tgt))
ds_cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
          "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
          "zero_optimization": {"stage": 1}}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=[q for q in model.parameters()], config=ds_cfg)
x = torch.randn(1, args.hidden, generator=torch.Generator().manual_seed(7))
engine.train_batch(data_iter=iter([(x, x)]))
engine.save_checkpoint(args.out)
if dist.get_rank() == 0:
    n = args.layers * (args.hidden * args.hidden + args.hidden)
    print(f"wrote {args.out}: {args.stages} stages, {n / 1e6:.0f}M params, parts {model.parts}, "
          f"{time.time() - t0:.0f} s", flush=True)
dist.barrier()
