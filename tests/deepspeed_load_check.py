"""Load a (repaired) checkpoint with DeepSpeed's own engine.load_checkpoint() and compare the module.

Run under the DeepSpeed launcher with the fixture's world size:

    DS_ACCELERATOR=cpu deepspeed --num_gpus WS --master_port P tests/deepspeed_load_check.py \
        --fixture NAME --ckpt DIR --expect EXPECTED.safetensors [--device cuda] [--no-buffer-dtype]

EXPECTED holds name -> fp32 values the loaded module must hold (compared after casting the expected
value to the module's dtype). Rank 0 prints one line: "PASS <ckpt>" or "FAIL <ckpt>: <why>"; exit 0/1.
"""
import argparse
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import fixture_models as fm

p = argparse.ArgumentParser()
p.add_argument("--fixture", required=True)
p.add_argument("--ckpt", required=True)
p.add_argument("--expect", required=True)
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--no-buffer-dtype", action="store_true", help="drop data_types.buffer_dtype from the config")
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--force-cpu-fp16", action="store_true", help="let DeepSpeed's CPU accelerator run fp16 (as "
               "tests/fixtures/generate.py does for the *_cpuforced fixtures)")
args = p.parse_args()
if args.force_cpu_fp16:
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]

import deepspeed
from ds_launch import gloo_only
from safetensors.torch import load_file

gloo_only()  # no JIT C++ build of DeepSpeed's shm op (see tests/ds_launch.py)

spec = fm.FIXTURES[args.fixture]
cfg = fm.ds_config(spec)
if args.no_buffer_dtype:
    cfg.get("data_types", {}).pop("buffer_dtype", None)
deepspeed.init_distributed()
rank = dist.get_rank()
if args.device == "cuda":
    torch.cuda.set_device(args.local_rank % torch.cuda.device_count())
model = fm.build_model(spec)
engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=fm.model_parameters(model, spec), config=cfg)
problems = []
try:
    path, _ = engine.load_checkpoint(args.ckpt)
    if path is None:
        problems.append("load_checkpoint returned None (nothing loaded)")
except Exception as e:  # noqa: BLE001 - report any failure as FAIL
    problems.append(f"load_checkpoint raised {type(e).__name__}: {e}")
if not problems:
    expect = load_file(args.expect)
    module = engine.module
    all_params = dict(module.named_parameters())
    gathered = [q for q in all_params.values() if hasattr(q, "ds_id")]
    with deepspeed.zero.GatheredParameters(gathered):
        state = {k: v.detach().cpu().clone() for k, v in module.state_dict().items()}
    for name, want in expect.items():
        got = state.get(name)
        if got is None:
            problems.append(f"{name} missing from the module")
        elif not torch.isfinite(got.float()).all():
            problems.append(f"{name} is non-finite in the loaded module ({got.dtype})")
        elif not torch.equal(got, want.to(got.dtype)):
            problems.append(f"{name} differs from the expected values ({got.dtype})")
if rank == 0:
    print(f"PASS {args.ckpt}" if not problems else f"FAIL {args.ckpt}: " + "; ".join(problems), flush=True)
dist.barrier()
sys.exit(1 if problems else 0)
