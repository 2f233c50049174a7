"""Write the two checkpoints of bench/autoep.py: one Mixtral-shaped MoE model (8 experts, top-2), once with DeepSpeed
AutoEP (``expert_parallel.autoep_size 2``, EP 2 x expert-DP 1) and once data-parallel only (the same HF model, no
AutoEP, DP 2), same ZeRO stage and dtype, one step. Run on 2 CPU ranks:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29731 bench/make_autoep_checkpoints.py \
        --ep 2 --out bench/out/autoep-mixtral --hidden 512 --layers 4
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29732 bench/make_autoep_checkpoints.py \
        --ep 1 --out bench/out/dense-mixtral --hidden 512 --layers 4

Random init from a config (no download). Expert FFN 3.5x hidden, GQA 4:1, vocab 32000. ``--hidden 512 --layers 4``:
about 0.12B parameters; ``--hidden 2048 --layers 4``: about 1.3B (the issue's size; needs ~25 GB of RAM on 2 ranks).
transformers 5.23 needs the test-only shim tests/autoep_compat.py for DeepSpeed 0.19.8's AutoEP (applied here).
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--ep", type=int, required=True, choices=[1, 2])
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=512)
p.add_argument("--layers", type=int, default=4)
p.add_argument("--experts", type=int, default=8)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--stage", type=int, default=2)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
args = p.parse_args()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import autoep_compat

autoep_compat.apply()
import deepspeed
import torch.distributed as dist
from ds_launch import gloo_only
from transformers import MixtralConfig, MixtralForCausalLM

gloo_only()
deepspeed.init_distributed("gloo")
t0 = time.time()
torch.manual_seed(1234)
heads = args.hidden // 64
cfg = MixtralConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2,
                    num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                    num_local_experts=args.experts, num_experts_per_tok=2, max_position_embeddings=64,
                    tie_word_embeddings=False, router_aux_loss_coef=0.0)
model = MixtralForCausalLM(cfg)
ds_cfg = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": True},
    **({"expert_parallel": {"enabled": True, "autoep_size": args.ep, "preset_model": "mixtral"}} if args.ep > 1 else {}),
}
n_params = sum(q.numel() for q in model.parameters())
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
ids = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(dist.get_rank()))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
engine.save_checkpoint(args.out)
if dist.get_rank() == 0:
    cfg.save_pretrained(args.out)
    print(f"wrote {args.out}: {n_params / 1e9:.3f}B params, EP {args.ep}, {time.time() - t0:.0f} s", flush=True)
dist.barrier()
