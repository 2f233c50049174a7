"""A real Hugging Face Trainer + DeepSpeed run on CPU ranks with dsckpt's TrainerScanCallback (issue 39 item 3).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port P tests/hf_watch_check.py --out DIR --report R.json \
        --on-finding stop

The fixture's tiny Llama (tests/fixtures/hf_models.py: from a config, never the Hub), ZeRO-2, bf16, a checkpoint
every 3 steps, up to MAX_STEPS. The model carries one persistent float buffer, ``health`` (4 zeros), saved in every
checkpoint's module state like a BatchNorm statistic. After step INJECT_STEP every rank writes +inf into
``health[1]``: checkpoint-3 is clean, checkpoint-6 and every later one carry the inf. So that the check of the
right checkpoint is not left to scheduling, rank 0 lets step INJECT_STEP end only once checkpoint-3's scan record
is there (every rank waits at the next collective). Rank 0 writes the report: the Trainer's final step, its
``dsckpt/*`` log history, each rank's offered checkpoints; every rank marks itself done (tests/ds_launch.py).
"""
import argparse
import json
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import hf_models as hm

p = argparse.ArgumentParser()
p.add_argument("--out", required=True)
p.add_argument("--report", required=True)
p.add_argument("--on-finding", default="stop", choices=["log", "stop"])
p.add_argument("--max-steps", type=int, default=60)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
args = p.parse_args()

INJECT_STEP = 4

import torch.distributed as dist
from ds_launch import gloo_only, mark_rank_done
from transformers import Trainer, TrainerCallback

from dsckpt.callbacks import TrainerScanCallback
from dsckpt.scan_record import record_path

gloo_only()


class Inject(TrainerCallback):
    def __init__(self, model):
        self.model = model

    def on_step_end(self, args_, state, control, **kw):
        if state.global_step != INJECT_STEP:
            return
        if state.is_world_process_zero:
            first = os.path.join(args_.output_dir, "checkpoint-3")
            end = time.monotonic() + 300
            while not os.path.exists(record_path(first)) and time.monotonic() < end:
                time.sleep(0.05)
        with torch.no_grad():
            self.model.health[1] = float("inf")


model = hm.make_model("llama")
model.register_buffer("health", torch.zeros(4))
targs = hm.training_args(args.out, 2, max_steps=args.max_steps)
scan_cb = TrainerScanCallback(on_finding=args.on_finding, wait_at_end_s=300)
trainer = Trainer(model=model, args=targs, train_dataset=hm.TokenData(), processing_class=hm.make_tokenizer(),
                  callbacks=[Inject(model), scan_cb])
t0 = time.monotonic()
trainer.train()
offered = [None] * dist.get_world_size()
dist.all_gather_object(offered, sorted(str(x) for x in scan_cb.session.offered))
if dist.get_rank() == 0:
    out = {"world_size": dist.get_world_size(), "final_global_step": trainer.state.global_step,
           "max_steps": args.max_steps, "train_s": time.monotonic() - t0, "offered": offered,
           "dsckpt_log": [e for e in trainer.state.log_history if any(k.startswith("dsckpt/") for k in e)],
           "outcomes": [o.to_dict() for o in scan_cb.session.seen]}
    with open(args.report, "w") as f:
        json.dump(out, f, indent=1)
dist.barrier()
mark_rank_done(args.report)
