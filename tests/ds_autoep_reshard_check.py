"""Load resharded AutoEP checkpoints with real DeepSpeed at their new layout and check them against the truth.

    DS_ACCELERATOR=cpu deepspeed --num_gpus N --master_port P tests/ds_autoep_reshard_check.py \
        --result out.json FIXTURE=RESHARDED_DIR [FIXTURE=RESHARDED_DIR ...]

FIXTURE names an ``autoep/<name>`` fixture (tests/fixtures/generate_autoep.py); ``FIXTURE@E=UNIVERSAL_DIR`` loads a
universal folder (``reshard --universal``, equal to ``ds_to_universal``'s) with ``"load_universal": true`` at
expert-parallel size E: DeepSpeed's own route to another EP size, the second truth of the EP-change tests. The
expert-parallel size of the
resumed run and its ZeRO stage are the ones RESHARDED_DIR records (``expert_parallel.autoep_size`` and
``zero_optimization.stage`` of its saved config). Per pair: build
the fixture's tiny HF model, ``deepspeed.initialize`` with AutoEP at that size on N ranks, plain
``engine.load_checkpoint(dir)``, then compare with ``truth.safetensors`` (full stacked tensors; this rank's experts
are the slice its live param's AutoEP record names):

* fp32 master and both Adam moments of every param (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``)
  and the module copy, bit for bit; Adam step, global_steps/samples;
* logits on the fixed input, recomputed on this CPU: within ``ds_launch.logits_slack`` of the recorded ones at the
  source's EP size (1e-5 fp32, two bf16 ulps); at another EP size also within the difference recorded at generation
  time between the engine and a plain HF model on the same weights (another reduction order: AutoEP's grouped
  matmul over other expert groupings);
* one more training step (finite loss, Adam step + 1).

transformers 5.23 needs the test-only shim of ``tests/autoep_compat.py`` for DeepSpeed 0.19.8's AutoEP.
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
import autoep_models as am

p = argparse.ArgumentParser()
p.add_argument("pairs", nargs="+", help="FIXTURE_NAME=RESHARDED_SAVE_DIR")
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--result", default=None)
p.add_argument("--fixtures", default=os.path.join(HERE, "fixtures", "autoep"))
args = p.parse_args()

import autoep_compat

autoep_compat.apply()
import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_launch import gloo_only, logits_slack, report_checks
from safetensors.torch import load_file

gloo_only()
deepspeed.init_distributed("gloo")
rank = dist.get_rank()
world = dist.get_world_size()


def saved_layout(ckpt_dir):
    """(expert-parallel size, ZeRO stage) of the resharded save: from its saved config."""
    tag = open(os.path.join(ckpt_dir, "latest")).read().strip()
    name = "mp_rank_00_model_states.pt"
    if not os.path.exists(os.path.join(ckpt_dir, tag, name)):
        name = "zero_pp_rank_0_mp_rank_00_model_states.pt"  # ZeRO-3
    ms = torch.load(os.path.join(ckpt_dir, tag, name), map_location="cpu",
                    weights_only=False)  # our own output of a trusted fixture
    cfg = ms["ds_config"]
    return int(cfg["expert_parallel"]["autoep_size"]), int(cfg["zero_optimization"]["stage"])


def check_one(name, ckpt_dir):
    problems = []
    universal = os.path.exists(os.path.join(ckpt_dir, "latest_universal"))
    name, _, want_ep = name.partition("@")  # FIXTURE@EP: a universal folder, loaded at that EP size
    spec = dict(am.AUTOEP_FIXTURES[name])
    if universal:  # DeepSpeed's own route to another EP size: "checkpoint": {"load_universal": true}
        ep, stage = int(want_ep), spec["stage"]
    else:
        ep, stage = saved_layout(ckpt_dir)
    spec["stage"] = stage
    cfg = am.ds_config({**spec, "ep": ep})
    cfg["train_batch_size"] = am.MICRO_BATCH * world
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    meta = json.load(open(os.path.join(args.fixtures, name, "truth.json")))
    truth = load_file(os.path.join(args.fixtures, name, "truth.safetensors"))
    model = am.make_model(spec["arch"])  # values are overwritten by the load
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    load_path, _ = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint returned None for {ckpt_dir}"]
    if spec["stage"] in (1, 2):  # groups >= 1 are never linked for the fragment API in 0.19.8 (generate_autoep.py)
        engine.optimizer._hp_optimizer_states_linked = False
        engine.optimizer._lazy_init_hp_params_optimizer_state()
    for n, q in engine.module.named_parameters():
        uc = getattr(q, "ds_autoep_uc_meta", None)
        got = {"param": safe_get_full_fp32_param(q), "exp_avg": safe_get_full_optimizer_state(q, "exp_avg"),
               "exp_avg_sq": safe_get_full_optimizer_state(q, "exp_avg_sq")}
        if spec["stage"] < 3:
            got["lowp"] = q.data
        for key, t in got.items():
            want = truth[f"{key}/{n}"]
            if uc is not None:
                want = want[list(uc["local_experts"])]
            if t is None or not torch.equal(t.detach().cpu().reshape(want.shape).to(want.dtype), want):
                problems.append(f"{key} of '{n}' differs from the source")
    for attr in ("global_steps", "global_samples", "skipped_steps"):
        if getattr(engine, attr) != meta[attr]:
            problems.append(f"{attr} {getattr(engine, attr)} != {meta[attr]}")
    base = getattr(engine.optimizer, "optimizer", engine.optimizer)
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if steps != meta["adam_step"]:
        problems.append(f"Adam step {steps} != {meta['adam_step']}")
    engine.eval()
    with torch.no_grad():
        logits = engine(input_ids=truth["input_ids"]).logits.detach().float()
    diff = float((logits - truth["logits"]).abs().max())
    # this CPU recomputes the logits: within logits_slack of the recording machine's at the source's EP size, plus
    # the recorded engine-vs-plain-model difference at another EP size (experts summed in another order)
    bound = logits_slack(float(truth["logits"].abs().max()), spec["dtype"])
    if ep != meta["ep_size"]:
        bound += meta["crosscheck"]["hf_model_logits"]["max_abs_diff_fp32_hf_model_vs_engine"]
    if diff > bound:
        problems.append(f"logits differ by {diff:.3g} from the source engine's (allowed {bound:.3g} at EP {ep})")
    if rank == 0:
        print(f"[{name}] EP {meta['ep_size']} -> {ep} on {world} ranks: logits max abs diff {diff:.3g}", flush=True)
    engine.train()
    ids = am.make_batch(am.STEPS, rank, meta["model_config"]["vocab_size"])
    loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss):
        problems.append(f"loss after resume is {float(loss)}")
    after = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if after != [s + 1 for s in meta["adam_step"]] or engine.global_steps != meta["global_steps"] + 1:
        problems.append(f"after one more step: Adam step {after}, global_steps {engine.global_steps}")
    return problems


report_checks(args.pairs, check_one, args.result)
