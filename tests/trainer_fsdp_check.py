"""Resume a Trainer fixture under FSDP2 from a ``dsckpt to-dcp`` folder and report what the Trainer loaded.

    torchrun --nproc-per-node 2 tests/trainer_fsdp_check.py --report R.json NAME=OUT [NAME=OUT ...]

Builds the fixture's model, tokenizer and data (tests/fixtures/hf_models.py) and its TrainingArguments with
``fsdp_version: 2`` (SHARDED_STATE_DICT) instead of DeepSpeed, on CPU ranks (tests/fsdp_cpu.py), and calls
``Trainer.train(resume_from_checkpoint=OUT)`` for one more step. At that step's start (after every load) every
rank gathers the full params and optimizer state (``get_model_state_dict`` / ``get_optimizer_state_dict`` with
``full_state_dict``) and compares them with the fixture's truth bit for bit: trained params with DeepSpeed's fp32
masters, frozen ones with their saved values, ``exp_avg``, ``exp_avg_sq``, ``step``; and records the global step,
each group's hyper-parameters and the scheduler's state. The step's logged loss is in the report
(``log``). Several NAME=OUT pairs resume one after the other in the same launch (Accelerate's state is reset
between them). Rank 0 writes the reports as a JSON list.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
sys.path.insert(0, HERE)
import hf_models as hm
from fsdp_cpu import allow_fsdp_on_cpu

p = argparse.ArgumentParser()
p.add_argument("--report", required=True)
p.add_argument("pairs", nargs="+", help="NAME=OUT: a fixture name and the to-dcp folder to resume it from")
args = p.parse_args()

# DSCKPT_FSDP_DEVICE=cuda: on a GPU host, Accelerate's own FSDP path with no patch (tests/fsdp_cpu.py is for CPU ranks)
ON_GPU = os.environ.get("DSCKPT_FSDP_DEVICE") == "cuda"
if not ON_GPU:
    allow_fsdp_on_cpu()
from accelerate.state import AcceleratorState
from ds_launch import mark_rank_done
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_optimizer_state_dict
from transformers import Trainer, TrainerCallback, TrainingArguments


class Probe(TrainerCallback):
    trainer = None

    def __init__(self, truth: dict, meta: dict) -> None:
        self.report: dict = {}
        self.truth, self.meta = truth, meta

    def on_step_begin(self, args_, state, control, **kw):
        if self.report:
            return
        tr = self.trainer
        full = StateDictOptions(full_state_dict=True, cpu_offload=False)
        msd = get_model_state_dict(tr.model, options=full)
        osd = get_optimizer_state_dict(tr.model, tr.optimizer, options=full)
        mism, checked, truth, meta = [], 0, self.truth, self.meta
        for n in meta["state_dict_names"]:
            if n in meta["buffers"]:
                continue
            checked += 1
            if not torch.equal(msd[n].float().cpu(), truth[f"param/{n}"]):
                mism.append(f"param/{n}")
        steps = set()
        for n in (n for n in meta["trainable"] if n not in meta["tied"]):  # a tied alias has its state under its source
            st = osd["state"].get(n)
            if st is None:
                mism.append(f"no optimizer state for {n}")
                continue
            for key in ("exp_avg", "exp_avg_sq"):
                checked += 1
                if not torch.equal(st[key].float().cpu(), truth[f"{key}/{n}"]):
                    mism.append(f"{key}/{n}")
            steps.add(float(st["step"]))
        self.report = {
            "global_step_at_resume": state.global_step, "checked": checked, "mismatch": mism,
            "steps": sorted(steps), "is_fsdp2": bool(tr.is_fsdp_enabled and tr.accelerator.is_fsdp2),
            "fsdp": [str(tr.accelerator.distributed_type), getattr(tr.accelerator.state.fsdp_plugin, "fsdp_version", None),
                     type(next(tr.model.parameters())).__name__],
            "groups": [{k: v for k, v in g.items() if k != "params"} | {"n_params": len(g["params"])}
                       for g in tr.optimizer.param_groups],
            "scheduler": {k: v for k, v in tr.lr_scheduler.state_dict().items() if k != "lr_lambdas"},
        }


def resume(name: str, ckpt: str, run_dir: str) -> dict:
    spec = hm.HF_FIXTURES[name]
    with open(os.path.join(HERE, "fixtures", name, "truth.json")) as f:
        meta = json.load(f)
    targs = TrainingArguments(
        output_dir=run_dir, use_cpu=not ON_GPU, bf16=True, seed=hm.SEED, per_device_train_batch_size=hm.MICRO_BATCH,
        max_steps=hm.SAVE_STEPS + 1, save_strategy="no", logging_steps=1, learning_rate=1e-2, weight_decay=0.01,
        lr_scheduler_type="linear", report_to=[], dataloader_num_workers=0, disable_tqdm=True,
        fsdp=True, fsdp_config={"fsdp_version": 2, "state_dict_type": "SHARDED_STATE_DICT"},
    )
    probe = Probe(load_file(os.path.join(HERE, "fixtures", name, "truth.safetensors")), meta)
    trainer = Trainer(model=hm.make_model(spec["arch"]), args=targs, train_dataset=hm.TokenData(),
                      processing_class=hm.make_tokenizer(), callbacks=[probe])
    probe.trainer = trainer
    trainer.train(resume_from_checkpoint=ckpt)
    reports = [None] * dist.get_world_size()
    dist.all_gather_object(reports, probe.report)
    return {"fixture": name, "ckpt": ckpt, "world_size": dist.get_world_size(), "ranks": reports,
            "final_global_step": trainer.state.global_step,
            "log": [e for e in trainer.state.log_history if "loss" in e]}


out = []
for i, pair in enumerate(args.pairs):
    name, ckpt = pair.split("=", 1)
    out.append(resume(name, ckpt, os.path.join(os.path.dirname(os.path.abspath(args.report)), f"run{i}")))
    AcceleratorState._reset_state(True)  # the next Trainer makes its Accelerator afresh (the process group stays)
if dist.get_rank() == 0:
    with open(args.report, "w") as f:
        json.dump(out, f, indent=1, default=str)
dist.barrier()
mark_rank_done(args.report)
