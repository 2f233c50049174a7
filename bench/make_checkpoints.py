"""Write real DeepSpeed checkpoints for the benchmark, with DeepSpeed itself on CPU.

Run it through the DeepSpeed launcher (2 ranks):

    DS_ACCELERATOR=cpu /work/venv/bin/deepspeed --num_gpus 2 --master_port 29611 \
        bench/make_checkpoints.py --params 200M --stage 2 --out bench/out/zero2-200m

The model is a stack of ``hidden x hidden`` Linear layers (``--hidden``, default 4096), so the largest
single tensor is the same at every size and only the layer count grows. bf16, Adam (``torch_adam``),
one optimizer step, then ``save_checkpoint``.
"""

from __future__ import annotations

import argparse
import os
import time


def parse_count(text: str) -> int:
    text = text.strip().upper()
    mult = {"K": 10**3, "M": 10**6, "G": 10**9, "B": 10**9}.get(text[-1:], 1)
    return int(float(text.rstrip("KMGB")) * mult)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--params", default="200M", help="approximate parameter count (e.g. 50M, 200M)")
    ap.add_argument("--hidden", type=int, default=4096, help="width of each Linear layer")
    ap.add_argument("--stage", type=int, choices=[1, 2, 3], default=2)
    ap.add_argument("--out", required=True, help="save dir (gets 'latest' and the tag folder)")
    ap.add_argument("--local_rank", type=int, default=-1)  # passed by the launcher
    args = ap.parse_args()

    import importlib

    import deepspeed
    import torch

    # Collectives through gloo: DeepSpeed's CPU shared-memory op would be JIT-compiled first (minutes on a fresh
    # host) and leaves its buffers in /dev/shm after every run (see tests/ds_launch.py).
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None

    torch.manual_seed(0)
    per_layer = args.hidden * args.hidden + args.hidden
    layers = max(1, round(parse_count(args.params) / per_layer))
    model = torch.nn.Sequential(*[torch.nn.Linear(args.hidden, args.hidden) for _ in range(layers)])
    n_params = sum(p.numel() for p in model.parameters())
    config = {
        "train_micro_batch_size_per_gpu": 1,
        "gradient_accumulation_steps": 1,
        "bf16": {"enabled": True},
        "zero_optimization": {"stage": args.stage},
        "optimizer": {"type": "Adam", "params": {"lr": 1e-4, "torch_adam": True}},
    }
    t0 = time.time()
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=config)
    x = torch.randn(1, args.hidden, dtype=torch.bfloat16)
    loss = engine(x).float().pow(2).mean()
    engine.backward(loss)
    engine.step()
    engine.save_checkpoint(args.out)
    if engine.global_rank == 0:
        print(f"wrote {args.out}: stage {args.stage}, {layers} layers x {args.hidden}, "
              f"{n_params:,} params, {time.time() - t0:.0f} s", flush=True)
    if torch.distributed.is_initialized():
        torch.distributed.barrier()
    os._exit(0)  # skip slow interpreter teardown of the distributed backend


if __name__ == "__main__":
    main()
