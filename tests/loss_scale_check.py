"""Resume the fp16 run at its loss-scale floor (tests/fixtures/lossfloor/s2_fp16_w2) with DeepSpeed itself, before and
after ``dsckpt repair --loss-scale``, and feed each an overflowing batch (issue 39 item 4).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 2 --master_port P tests/loss_scale_check.py \
        --source RUN/ckpt --rescued OUT --result RESULT.json

fp16 is forced on DeepSpeed's CPU accelerator as the fixture's generator did; the config is the run's own
(truth.json ``config``). An overflowing batch is the generator's loss spike (loss x 1e6). Two engines, one after the
other, each built as the run was and loaded with plain ``engine.load_checkpoint``:

* source (``latest`` = global_step6, scale at its floor 8): one overflowing batch; DeepSpeed's exception is recorded;
* rescued: the scale it loaded, then two overflowing batches and a clean one (scale and hysteresis after each),
  skipped steps, and whether the BN running stats are finite.

Rank 0 writes RESULT as JSON; the test decides from it.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import fixture_models as fm

p = argparse.ArgumentParser()
p.add_argument("--source", required=True)
p.add_argument("--rescued", required=True)
p.add_argument("--result", required=True)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
args = p.parse_args()

from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

CPU_Accelerator.is_fp16_supported = lambda self: True
CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]

import deepspeed
from ds_launch import gloo_only

gloo_only()
truth = json.load(open(os.path.join(HERE, "fixtures", "lossfloor", "s2_fp16_w2", "truth.json")))
cfg = truth["config"]
SPIKE = truth["spike_factor"]
deepspeed.init_distributed()
rank = dist.get_rank()
if fm.needs_gloo_all_gather_fallback(deepspeed.__version__, torch.__version__, truth["stage"]):
    from deepspeed.comm import comm as ds_comm
    ds_comm.cdb.all_gather_function = None


def engine_from(ckpt):
    model = fm.build_model({})
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    path, _ = engine.load_checkpoint(ckpt)
    assert path is not None, f"nothing loaded from {ckpt}"
    return engine


def train_step(engine, step, spike):
    ids, tgt = fm.make_batch(100 + step, rank)
    loss = F.cross_entropy(engine(ids).float(), tgt)
    engine.backward(loss * SPIKE if spike else loss)
    engine.step()


result = {}
src = engine_from(args.source)
result["source"] = {"loaded_scale": float(src.optimizer.loss_scaler.cur_scale), "error": None}
try:
    train_step(src, 0, spike=True)
except Exception as e:  # noqa: BLE001 - DeepSpeed raises a bare Exception at the floor
    result["source"]["error"] = f"{type(e).__name__}: {e}"
del src

eng = engine_from(args.rescued)
s = eng.optimizer.loss_scaler
r = {"loaded_scale": float(s.cur_scale), "engine_cur_scale": float(eng.optimizer.cur_scale), "error": None,
     "loaded": {k: getattr(s, k) for k in ("cur_iter", "last_overflow_iter", "cur_hysteresis", "min_scale")},
     "scales": [], "hysteresis": []}
try:
    for i, spike in enumerate((True, True, False)):
        train_step(eng, i, spike)
        r["scales"].append(float(eng.optimizer.loss_scaler.cur_scale))
        r["hysteresis"].append(int(eng.optimizer.loss_scaler.cur_hysteresis))
except Exception as e:  # noqa: BLE001
    r["error"] = f"{type(e).__name__}: {e}"
r["skipped_steps"] = int(eng.skipped_steps)
r["global_steps"] = int(eng.global_steps)
r["bn_finite"] = bool(torch.isfinite(eng.module.bn.running_mean).all() and torch.isfinite(eng.module.bn.running_var).all())
result["rescued"] = r
dist.barrier()
if rank == 0:
    with open(args.result, "w") as f:
        json.dump(result, f, indent=1, default=str)
    print(json.dumps(result, default=str), flush=True)
dist.barrier()
