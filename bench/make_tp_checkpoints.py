"""Write the two checkpoints of bench/tp.py: one Llama, once with AutoTP (TP 2 x DP 1) and once data-parallel
only (TP 1 x DP 2), same ZeRO stage and dtype, one step. Run on 2 CPU ranks:

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29631 bench/make_tp_checkpoints.py \
        --tp 2 --out bench/out/tp2-llama --hidden 1024 --layers 8
    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port 29632 bench/make_tp_checkpoints.py \
        --tp 1 --out bench/out/dp2-llama --hidden 1024 --layers 8

The model is built from a config with random init (no download): GQA Llama, vocab 32000, intermediate 4x hidden.
With ``--hidden 1024 --layers 8`` it has 200M parameters; a ZeRO-1 bf16 checkpoint is about 2.8 GB either way.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

import torch

p = argparse.ArgumentParser()
p.add_argument("--tp", type=int, required=True, choices=[1, 2])
p.add_argument("--out", required=True)
p.add_argument("--hidden", type=int, default=1024)
p.add_argument("--layers", type=int, default=8)
p.add_argument("--vocab", type=int, default=32000)
p.add_argument("--stage", type=int, default=1)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
args = p.parse_args()

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
import deepspeed
import torch.distributed as dist
from ds_launch import gloo_only
from transformers import LlamaConfig, LlamaForCausalLM

gloo_only()
deepspeed.init_distributed("gloo")
t0 = time.time()
torch.manual_seed(1234)
heads = args.hidden // 64
cfg = LlamaConfig(vocab_size=args.vocab, hidden_size=args.hidden, intermediate_size=4 * args.hidden,
                  num_hidden_layers=args.layers, num_attention_heads=heads, num_key_value_heads=max(2, heads // 4),
                  max_position_embeddings=64, tie_word_embeddings=False)
model = LlamaForCausalLM(cfg)
ds_cfg = {
    "train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "steps_per_print": 1000,
    "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    "zero_optimization": {"stage": args.stage}, "bf16": {"enabled": True},
    **({"tensor_parallel": {"autotp_size": args.tp}} if args.tp > 1 else {}),
}
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=ds_cfg)
ids = torch.randint(0, args.vocab, (1, 16), generator=torch.Generator().manual_seed(7))
loss = engine(input_ids=ids, labels=ids).loss
engine.backward(loss)
engine.step()
engine.save_checkpoint(args.out)
if dist.get_rank() == 0:
    n = sum(q.numel() for q in LlamaForCausalLM(cfg).parameters()) if args.tp > 1 else \
        sum(q.numel() for q in model.parameters())
    print(f"wrote {args.out}: TP {args.tp}, {n / 1e6:.0f}M params, {time.time() - t0:.0f} s", flush=True)
dist.barrier()
