"""Load resharded Mixture-of-Experts checkpoints with real DeepSpeed and check them against the truth.

    DS_ACCELERATOR=cpu deepspeed --num_gpus N --master_port P tests/ds_moe_reshard_check.py \
        --result out.json FIXTURE=RESHARDED_DIR [FIXTURE=RESHARDED_DIR ...]
    ... tests/ds_moe_reshard_check.py FIXTURE@STAGE=DIR ...   # written for ZeRO stage STAGE (0, 1, 2)

The MoE twin of ``ds_reshard_check.py`` (``moe_*`` fixtures, ``moe_models.MoENet``): rebuild the model for
this rank's expert-parallel rank with the ep_size the resharded save was written for (its expert group's name) and DeepSpeed's own MoE param groups
(train_batch_size adapted to N ranks), plain ``engine.load_checkpoint(dir)``, then compare exactly with
``truth.safetensors``, whose expert tensors carry *global* expert names: each rank's local expert ``l`` is
global expert ``ep_rank * num_local_experts + l``.

* fp32 master + Adam moments of every param this rank holds, through ``safe_get_full_fp32_param`` /
  ``safe_get_full_optimizer_state`` (stage 0: the param, or in bf16 ``FP16_UnfusedOptimizer``'s master or
  ``FP16_Optimizer``'s flat master cut at the param, and the inner optimizer's state) and, for ZeRO, through the optimizer's own flat partitions gathered over each
  group's ZeRO process group (all ranks for dense groups, the expert-data-parallel group for expert
  groups) and cut at DeepSpeed's live param offsets;
* module (16-bit) weights, the expert-parallel rank DeepSpeed assigned, Adam step, global_steps/samples;

then one more training step. Prints ``PASS``/``FAIL`` on rank 0; ``--result`` writes a JSON list.
"""
import argparse
import json
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import fixture_models as fm
import moe_models as mm

p = argparse.ArgumentParser()
p.add_argument("pairs", nargs="+", help="FIXTURE_NAME=RESHARDED_SAVE_DIR")
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--result", default=None)
p.add_argument("--fixtures", default=os.path.join(HERE, "fixtures"))
args = p.parse_args()

import deepspeed
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_launch import gloo_only, report_checks
from safetensors.torch import load_file

gloo_only()  # no JIT C++ build of DeepSpeed's shm op (see tests/ds_launch.py)

deepspeed.init_distributed()
rank = dist.get_rank()
world = dist.get_world_size()


def saved_ep_size(ckpt_dir):
    """The expert-parallel size the resharded save was written for: its expert param group's name (``ep_size_E``,
    groups.py), in rank 0's ZeRO optimizer file or, without ZeRO, in ``expp_rank_0``'s optimizer (our own output of
    a trusted fixture); None without one."""
    import glob
    import re

    tag = open(os.path.join(ckpt_dir, "latest")).read().strip()
    files = glob.glob(os.path.join(ckpt_dir, tag, "*zero_pp_rank_0_mp_rank_00_optim_states.pt"))
    expp = os.path.join(ckpt_dir, tag, "expp_rank_0_mp_rank_00_optim_states.pt")
    if files:
        groups = torch.load(files[0], map_location="cpu", weights_only=False)["optimizer_state_dict"][
            "base_optimizer_state"]["param_groups"]
    elif os.path.exists(expp):
        opt = torch.load(expp, map_location="cpu", weights_only=False)["optimizer"]
        groups = opt.get("optimizer_state_dict", opt)["param_groups"]
    else:
        return None
    sizes = {int(m[1]) for g in groups if g.get("moe") and (m := re.match(r"ep_size_(\d+)$", str(g.get("name"))))}
    return sizes.pop() if len(sizes) == 1 else None


def check_one(name, ckpt_dir):
    problems = []
    name, _, dtype = name.partition(":")  # NAME:DTYPE: a `reshard --dtype DTYPE` output (fp32 or bf16 here)
    name, _, target_stage = name.partition("@")
    spec = dict(fm.FIXTURES[name])
    if target_stage:  # reshard --zero-stage: the fixture's run at another stage
        spec["stage"] = int(target_stage)
    if dtype:  # the engine built with the target's precision (DeepSpeed's default wrapper: no data_types)
        spec["dtype"] = dtype
        spec.pop("extra", None)
    cfg = fm.ds_config(spec)
    if spec["stage"] == 0 and "grad_accum_dtype" in cfg.get("data_types", {}):
        # a BF16_Optimizer run resumed at stage 0, as reshard's hint says: bf16 with fp32 gradient accumulation and
        # no ZeRO stops deepspeed.initialize ("unsupported mix of model_dtype ... and grad_accum_dtype")
        cfg["data_types"] = {k: v for k, v in cfg["data_types"].items() if k != "grad_accum_dtype"}
    cfg["train_batch_size"] = fm.MICRO_BATCH * cfg.get("gradient_accumulation_steps", 1) * world
    ep = saved_ep_size(ckpt_dir) or spec["ep_size"]  # reshard --ep-size writes another one
    spec["ep_size"] = ep
    model = mm.build_moe_model(spec, rank % ep)  # values are overwritten by the load
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=mm.moe_param_groups(model), config=cfg)
    meta = json.load(open(os.path.join(args.fixtures, name, "truth.json")))
    truth = load_file(os.path.join(args.fixtures, name, "truth.safetensors"))
    load_path, _ = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint returned None for {ckpt_dir}"]
    opt = engine.optimizer
    stage = spec["stage"]
    base = opt
    while hasattr(base, "optimizer"):
        base = base.optimizer
    if stage:
        # groups >= 1 (the expert groups) are never linked for the fragment API in 0.19.8 (as in generate_moe.py)
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    layer = engine.module.moe
    ep_rank = groups._get_expert_parallel_rank(layer.expert_group_name)
    n_local = layer.num_local_experts

    def global_name(n):
        if not n.startswith(mm.EXPERT_PREFIX):
            return n
        local, rest = n[len(mm.EXPERT_PREFIX):].split(".", 1)
        return f"{mm.EXPERT_PREFIX}{ep_rank * n_local + int(local)}.{rest}"

    # stage-0 16-bit: FP16_UnfusedOptimizer's fp32_groups[g][i] is the master of fp16_groups[g][i] (its state keyed by
    # the master); FP16_Optimizer's fp32_groups_flat[g] is fp16_groups[g] concatenated (its state keyed by the flat)
    masters = {}
    if stage == 0 and hasattr(opt, "fp32_groups_flat"):
        for plist, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            st, off = base.state[flat], 0
            for q in plist:
                k = q.numel()
                masters[id(q)] = [t[off:off + k].view_as(q) for t in (flat.data, st["exp_avg"], st["exp_avg_sq"])]
                off += k
    elif stage == 0 and hasattr(opt, "fp32_groups"):
        for plist, mlist in zip(opt.fp16_groups, opt.fp32_groups):
            masters.update({id(q): [m.data, base.state[m]["exp_avg"], base.state[m]["exp_avg_sq"]]
                            for q, m in zip(plist, mlist)})
    seen = set()
    for n, q in engine.module.named_parameters():
        g = global_name(n)
        seen.add(g)
        if stage == 0:  # no ZeRO: the master (fp32: the param itself) and its torch optimizer state
            m, ea, eas = masters.get(id(q)) or [q.data, base.state[q]["exp_avg"], base.state[q]["exp_avg_sq"]]
            got = {"param": m, "exp_avg": ea, "exp_avg_sq": eas, "lowp": q.data}
        else:
            got = {"param": safe_get_full_fp32_param(q), "exp_avg": safe_get_full_optimizer_state(q, "exp_avg"),
                   "exp_avg_sq": safe_get_full_optimizer_state(q, "exp_avg_sq"), "lowp": q.data}
        for key, t in got.items():
            want = truth[f"{key}/{g}"]
            if dtype and key == "lowp":  # the module copy is the master cast, bit for bit
                want = truth[f"param/{g}"].to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
                if t.dtype != want.dtype or not torch.equal(t.detach().cpu(), want):
                    problems.append(f"module weight '{n}' (global '{g}') is not its master cast to {want.dtype}")
                continue
            if t is None or not torch.equal(t.detach().cpu().to(want.dtype), want):
                problems.append(f"{key} of '{n}' (global '{g}') differs from the source (fragment API)")
    expected = {n for n in meta["params"] if not n.startswith(mm.EXPERT_PREFIX)
                or int(n[len(mm.EXPERT_PREFIX):].split(".")[0]) // n_local == ep_rank}
    if seen != expected:
        problems.append(f"rank holds {sorted(seen ^ expected)} unlike expert-parallel rank {ep_rank}")
    # the optimizer's own flat partitions, gathered over each group's ZeRO process group
    inner = base
    if stage and hasattr(opt, "fp32_groups_flat_partition"):  # BF16_Optimizer: params one after the other
        offsets = [[sum(p.numel() for p in plist[:i]) for i in range(len(plist))] for plist in opt.bf16_groups]
        flat_groups = zip(opt.bf16_groups, offsets, opt.fp32_groups_flat_partition)
    else:
        flat_groups = zip(opt.round_robin_bit16_groups, opt.round_robin_bit16_offsets,
                          opt.single_partition_of_fp32_groups) if stage else []
    for gi, (plist, offs, part) in enumerate(flat_groups):
        pg = opt.real_dp_process_group[gi]
        size = dist.get_world_size(group=pg)
        flats = {}
        for key, t in (("param", part), ("exp_avg", inner.state[part]["exp_avg"]),
                       ("exp_avg_sq", inner.state[part]["exp_avg_sq"])):
            pieces = [torch.empty_like(t) for _ in range(size)]
            dist.all_gather(pieces, t.detach().float().contiguous(), group=pg)
            flats[key] = torch.cat(pieces)
        for q, off in zip(plist, offs):
            g = global_name(engine.param_names[q])
            for key, flat in flats.items():
                if not torch.equal(flat[off:off + q.numel()].view(q.shape), truth[f"{key}/{g}"]):
                    problems.append(f"flat partition {key} of '{g}' (group {gi}, {size} ranks) differs from the source")
    for attr in ("global_steps", "global_samples", "skipped_steps"):
        if getattr(engine, attr) != meta[attr]:
            problems.append(f"{attr} {getattr(engine, attr)} != {meta[attr]}")
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if steps != meta["optimizer_step"]:
        problems.append(f"Adam step {steps} != {meta['optimizer_step']}")
    dp_rank = dist.get_rank(group=groups._get_data_parallel_group())
    ids, tgt = mm.make_moe_batch(fm.STEPS, dp_rank)
    loss = mm.loss_of(engine(ids), tgt)
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss):
        problems.append(f"loss after resume is {float(loss)}")
    steps_after = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if steps_after != [s + 1 for s in meta["optimizer_step"]] or engine.global_steps != meta["global_steps"] + 1:
        problems.append(f"after one more step: Adam step {steps_after}, global_steps {engine.global_steps}")
    engine.destroy() if hasattr(engine, "destroy") else None
    return problems


report_checks(args.pairs, check_one, args.result)
