"""Resume an HF Trainer fixture from a (resharded) checkpoint folder and report what the Trainer loaded.

    DS_ACCELERATOR=cpu deepspeed --num_gpus N --master_port P tests/hf_trainer_check.py \
        --name hf_llama_z2_bf16_w2 --ckpt OUT --report report.json

Builds the fixture's model/tokenizer/data/TrainingArguments (tests/fixtures/hf_models.py) and calls
``Trainer.train(resume_from_checkpoint=OUT)``. At the first resumed step (before its forward pass) every rank
compares the engine's fp32 masters and Adam moments with the fixture's truth (bit for bit) and records the global
step; the RNG file the Trainer looked for and the torch CPU RNG state it restored are recorded too. Rank 0 writes the report as JSON.
"""
import argparse
import hashlib
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import hf_models as hm
import peft_models as pm

p = argparse.ArgumentParser()
p.add_argument("--name", required=True, choices=sorted(hm.HF_FIXTURES) + sorted(pm.PEFT_FIXTURES))
p.add_argument("--ckpt", required=True)
p.add_argument("--report", required=True)
p.add_argument("--micro-batch", type=int, default=hm.MICRO_BATCH)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
args = p.parse_args()

from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_launch import gloo_only, mark_rank_done
from safetensors.torch import load_file
from transformers import Trainer, TrainerCallback

gloo_only()  # no JIT C++ build of DeepSpeed's shm op (see tests/ds_launch.py)

# PEFT fixtures (tests/fixtures/peft/): the PeftModel the fixture trained; the Trainer resumes it with
# load_module_strict=False (the checkpoint holds only the adapter)
is_peft = args.name in pm.PEFT_FIXTURES
spec = pm.PEFT_FIXTURES[args.name] if is_peft else hm.HF_FIXTURES[args.name]
fixture_dir = os.path.join(HERE, "fixtures", "peft" if is_peft else "", args.name)
truth = load_file(os.path.join(fixture_dir, "truth.safetensors"))
class Probe(TrainerCallback):
    trainer = None

    def __init__(self) -> None:
        self.report: dict = {}

    def on_step_begin(self, args_, state, control, **kw):
        if self.report:
            return
        engine = self.trainer.model_wrapped
        if hasattr(engine.optimizer, "_lazy_init_hp_params_optimizer_state"):
            # ZeRO-1/2 link the optimizer-state fragments only after the first step (DeepSpeed 0.19.8); link now
            engine.optimizer._hp_optimizer_states_linked = False
            engine.optimizer._lazy_init_hp_params_optimizer_state()
        mism = []
        checked = 0
        for n, q in engine.module.named_parameters():
            if not q.requires_grad:
                continue
            for key, got in (("param", safe_get_full_fp32_param(q)),
                             ("exp_avg", safe_get_full_optimizer_state(q, "exp_avg")),
                             ("exp_avg_sq", safe_get_full_optimizer_state(q, "exp_avg_sq"))):
                checked += 1
                if not torch.equal(got.float().cpu(), truth[f"{key}/{n}"]):
                    mism.append(f"{key}/{n}")
        self.report = {
            "global_step_at_resume": state.global_step,
            "engine_global_steps": int(engine.global_steps),
            "checked": checked, "mismatch": mism,
            **rng_report,
        }


rng_report: dict = {}


class CheckedTrainer(Trainer):
    def _load_rng_state(self, checkpoint):
        # Nothing in this tiny run draws from torch's RNG, so the seeded state equals the saved one; move it away
        # first so that only a restored file can bring it back.
        torch.manual_seed(4321 + self.args.process_index)
        super()._load_rng_state(checkpoint)
        # which file the Trainer looked for, and the torch CPU RNG state right after it restored (or did not)
        name = f"rng_state_{self.args.process_index}.pth" if self.args.world_size > 1 else "rng_state.pth"
        rng_report.update(rng_file=name, rng_file_exists=os.path.isfile(os.path.join(checkpoint, name)),
                          cpu_rng_sha256=hashlib.sha256(torch.random.get_rng_state().numpy().tobytes()).hexdigest())


probe = Probe()
trainer = CheckedTrainer(model=pm.make_model(args.name) if is_peft else hm.make_model(spec["arch"]),
                  args=hm.training_args(os.path.join(os.path.dirname(args.report), "run"), spec["stage"],
                                        micro_batch=args.micro_batch),
                  train_dataset=hm.TokenData(), processing_class=hm.make_tokenizer(), callbacks=[probe])
probe.trainer = trainer
trainer.train(resume_from_checkpoint=args.ckpt)
reports = [None] * dist.get_world_size()
dist.all_gather_object(reports, probe.report)
if dist.get_rank() == 0:
    out = {"world_size": dist.get_world_size(), "ranks": reports, "final_global_step": trainer.state.global_step,
           "log": [e for e in trainer.state.log_history if "loss" in e]}
    with open(args.report, "w") as f:
        json.dump(out, f, indent=1)
dist.barrier()
mark_rank_done(args.report)  # last: the test trusts a complete report over the launcher's exit status
