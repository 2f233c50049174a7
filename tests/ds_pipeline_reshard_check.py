"""Load resharded pipeline checkpoints with real DeepSpeed (PipelineEngine) and check them against the source
fixture's truth (issue 32).

    DS_ACCELERATOR=cpu deepspeed --num_gpus 4 --master_port P tests/ds_pipeline_reshard_check.py \
        --result out.json FIXTURE@ppN[@universal|@z1|@z0]=DIR [...]
        tp_pipeline/MEGATRON_FIXTURE@ppN[@tpT][@z0]=DIR   # a tensor x pipeline fixture (check_megatron)

For each pair: the fixture's ``PipelineModule`` (fixture_models.pipeline_layers, partition_method uniform) built with
N stages on this launch's ranks (data-parallel size world / N) from a different seed, ``deepspeed.initialize`` with the
fixture's ds_config, plain ``engine.load_checkpoint(DIR)`` (``@universal``: ``"checkpoint": {"load_universal":
true}``, DeepSpeed's own route from a ``ds_to_universal`` folder), then, on every rank for the params of its stage:
fp32 master and Adam moments (``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``) equal to the recorded
truth bit for bit, frozen params and buffers equal to the saved ones (not for ``@universal``, whose loader restores
the optimizer's params only), every optimizer step and ``global_steps`` as saved; then one more ``train_batch``
runs with a finite loss. ``@z1``: a stage-0 fixture's output written as ZeRO-1 files, loaded at ZeRO-1 (bf16: with
fp32 gradient accumulation, BF16_Optimizer, as reshard writes it). ``@z0``: an fp32 fixture's output written without ZeRO, loaded
at ``"zero_optimization": {"stage": 0}`` (each stage's torch optimizer; the module weights are the master). Prints ``PASS``/``FAIL`` per pair on rank 0 (tests/ds_launch.py ``report_checks``).
"""
import argparse
import json
import math
import os
import sys

import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
sys.path.insert(0, HERE)
import fixture_models as fm
from ds_launch import gloo_only, report_checks

p = argparse.ArgumentParser()
p.add_argument("--result", default=None)
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", "0")))
p.add_argument("pairs", nargs="+")
args = p.parse_args()

import deepspeed
import torch.distributed as dist
from deepspeed.pipe import PipelineModule
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from safetensors.torch import load_file

gloo_only()
deepspeed.init_distributed("gloo")


def check_one(label: str, ckpt_dir: str) -> list[str]:
    name, *opts = label.split("@")
    pp = int(next(o[2:] for o in opts if o.startswith("pp")))
    if name.startswith("tp_pipeline/"):
        tp = next((int(o[2:]) for o in opts if o.startswith("tp")), None)
        return check_megatron(name, pp, ckpt_dir, tp, stage0="z0" in opts)
    universal = "universal" in opts
    spec = fm.FIXTURES[name]
    dtype = next((o[2:] for o in opts if o.startswith("dt")), None)  # @dtDTYPE: a `reshard --dtype DTYPE` output
    if dtype:  # the engine built with the target's precision (fp32 or bf16 here; DeepSpeed's default wrapper)
        spec = {**spec, "dtype": dtype}
    with open(os.path.join(HERE, "fixtures", name, "truth.json")) as fh:
        meta = json.load(fh)
    truth = load_file(os.path.join(HERE, "fixtures", name, "truth.safetensors"))
    cfg = fm.ds_config(spec)
    cfg.pop("train_batch_size", None)
    if "z1" in opts:  # a stage-0 run resharded as ZeRO-1 files (bf16: BF16_Optimizer, the same optimizer)
        cfg["zero_optimization"] = {"stage": 1}
        if spec.get("dtype") == "bf16" and not dtype:
            cfg["data_types"] = {"grad_accum_dtype": "fp32"}
    if "z0" in opts:  # an fp32 pipeline written at stage 0 (a torch optimizer per stage, no ZeRO files)
        cfg["zero_optimization"] = {"stage": 0}
    if universal:
        cfg["checkpoint"] = {"load_universal": True}
    model = PipelineModule(layers=fm.pipeline_layers(), num_stages=pp, loss_fn=lambda x, t: F.cross_entropy(x, t),
                           partition_method="uniform", seed_layers=True, base_seed=fm.SEED + 1)
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=[q for q in model.parameters() if q.requires_grad])
    problems = []
    load_path, _ = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint({ckpt_dir}) found nothing to load"]
    stage = engine.grid.get_stage_id()
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed links the optimizer-state fragments of the fragment API lazily at the first step (the fixture
        # generator and tests/ds_reshard_check.py do the same): before it, safe_get_full_optimizer_state fails
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    checked = 0
    base = engine.optimizer
    while hasattr(base, "optimizer"):
        base = base.optimizer
    for n, q in engine.module.named_parameters():
        if q.requires_grad:
            for key, t in fp32_and_moments(engine, q).items():
                want = truth[f"{key}/{n}"]
                if t is None or t.shape != want.shape or not torch.equal(t.float(), want):
                    problems.append(f"stage {stage}: {key} of {n} differs from the truth")
                checked += 1
            if dtype:  # the module copy is the master cast, bit for bit
                want = truth[f"param/{n}"].to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
                if q.dtype != want.dtype or not torch.equal(q.detach(), want):
                    problems.append(f"stage {stage}: module weight {n} is not its master cast to {want.dtype}")
                checked += 1
        elif not universal:
            want = truth.get(f"lowp/{n}", truth[f"param/{n}"])
            if dtype:  # a frozen param: its one stored copy cast to the target dtype
                want = want.to({"fp32": torch.float32, "bf16": torch.bfloat16}[dtype])
            if q.dtype != want.dtype and dtype or not torch.equal(q.detach().to(want.dtype), want):
                problems.append(f"stage {stage}: frozen {n} differs from the saved value")
    if not universal:
        for n, b in engine.module.named_buffers():
            want = truth.get(f"buffer/{n}")
            if dtype and want is not None and want.is_floating_point():  # floating buffers fp32
                want = want.float()
                if b.dtype != torch.float32:
                    problems.append(f"stage {stage}: buffer {n} is {b.dtype}, not fp32")
            if want is not None and not torch.equal(b.to(want.dtype), want):
                problems.append(f"stage {stage}: buffer {n} differs from the saved value")
    steps = {float(s["step"]) for s in base.state.values() if "step" in s}
    if steps != {float(meta["optimizer_step"][0])}:
        problems.append(f"stage {stage}: optimizer steps {sorted(steps)}, saved {meta['optimizer_step'][0]}")
    if engine.global_steps != meta["global_steps"]:
        problems.append(f"global_steps {engine.global_steps}, saved {meta['global_steps']}")
    if checked == 0 and any(q.requires_grad for q in engine.module.parameters()):
        problems.append(f"stage {stage}: nothing checked")
    ids, tgt = fm.make_batch(fm.STEPS, engine.grid.get_data_parallel_rank())
    loss = engine.train_batch(data_iter=iter([(ids, tgt)]))
    if not math.isfinite(float(loss)):
        problems.append(f"one more train_batch gave loss {float(loss)}")
    dist.barrier()
    return problems


def megatron_pipe_slice(truth, key: str, n: str, src_tp: int, tp: int, t: int):
    """Param ``n``'s ``key`` slice of TP rank ``t`` at TP size ``tp`` from the source's TP-local truth (``src_tp``
    ranks): merged by the model's own construction (the vocabulary's real rows, fc1's [gate; up] halves, fc2 on dim
    1, the rest replicated), then cut as the model cuts it at ``tp`` (tp_megatron_models: ``PADDED_VOCAB // tp`` rows
    per rank, the vocabulary's padding rows zero -- what DeepSpeed's universal loader gives them --, fc1's halves and
    fc2 in equal parts)."""
    import tp_megatron_models as mm

    parts = [truth[f"tp{r}/{key}/{n}"] for r in range(src_tp)]
    if n == "tied_modules.embed.word_embeddings.weight":
        full = torch.cat(parts, 0)[:mm.VOCAB]
        full = F.pad(full, (0, 0, 0, mm.PADDED_VOCAB - mm.VOCAB))
        return full.chunk(tp, 0)[t]
    if n.endswith("fc1.weight"):
        halves = [p.chunk(2, 0) for p in parts]
        gate, up = torch.cat([h[0] for h in halves], 0), torch.cat([h[1] for h in halves], 0)
        return torch.cat([gate.chunk(tp, 0)[t], up.chunk(tp, 0)[t]], 0)
    if n.endswith("fc2.weight"):
        return torch.cat(parts, 1).chunk(tp, 1)[t]
    return parts[0]


def fp32_and_moments(engine, q) -> dict:
    """Param ``q``'s fp32 master and Adam moments as the engine holds them: through the fragment API under ZeRO /
    BF16_Optimizer, else (fp32 without ZeRO) the module weight itself and the torch optimizer's state."""
    base = engine.optimizer
    while hasattr(base, "optimizer"):
        base = base.optimizer
    if engine.optimizer is base:
        return {"param": q.data, **{k: base.state[q].get(k) for k in ("exp_avg", "exp_avg_sq")}}
    return {"param": safe_get_full_fp32_param(q), "exp_avg": safe_get_full_optimizer_state(q, "exp_avg"),
            "exp_avg_sq": safe_get_full_optimizer_state(q, "exp_avg_sq")}


def check_megatron(name: str, pp: int, ckpt_dir: str, new_tp: int | None = None, stage0: bool = False) -> list[str]:
    """A Megatron-DeepSpeed-style TP x pipeline fixture (tests/fixtures/generate_tp_pipeline.py), rebuilt as it was
    made -- ``PipeModelDataParallelTopology(num_pp=pp, num_mp=T, num_dp=world / (T pp))`` (T the fixture's TP size,
    or ``new_tp`` for an output resharded to another TP size), the topology's ``model`` axis as TP groups,
    ``partition_method="type:BlockPipe"`` -- loaded with plain ``load_checkpoint``; on every rank each param's fp32
    master, Adam moments and 16-bit module slice equal the source's slice of the same TP rank (``tp{t}/...`` in
    truth.safetensors) bit for bit -- at another TP size the source's slices merged and cut for it
    (:func:`megatron_pipe_slice`) --, the optimizer step and global steps as saved; then one more ``train_batch``
    (two micro-batches) gives a finite loss. The fixture's frozen params (truth.json ``frozen``) are frozen again
    before ``deepspeed.initialize`` and zeroed (the rebuilt model's init is their saved value), so only what
    ``load_checkpoint`` reads from the layer files can give back their 16-bit slices; they must stay outside the
    optimizer (no fp32 master). ``stage0``: an fp32 output written without ZeRO, loaded at
    ``"zero_optimization": {"stage": 0}``."""
    import autotp_models as am
    import tp_megatron_models as mm
    fdir = os.path.join(HERE, "fixtures", name)
    with open(os.path.join(fdir, "truth.json")) as fh:
        meta = json.load(fh)
    truth = load_file(os.path.join(fdir, "truth.safetensors"))
    src_tp = meta["tp_size"]
    tp = new_tp or src_tp
    world = dist.get_world_size()
    model, _ = mm.pipe_module(pp, tp, world // (pp * tp))
    frozen = set(meta.get("frozen", []))
    with torch.no_grad():
        for n, q in model.named_parameters():
            if n in frozen:
                q.requires_grad_(False)
                q.zero_()
    cfg = dict(meta["config"])
    if stage0:
        cfg["zero_optimization"] = {"stage": 0}
    engine, _, _, _ = deepspeed.initialize(model=model, config=cfg,
                                           model_parameters=[q for q in model.parameters() if q.requires_grad])
    load_path, _ = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint({ckpt_dir}) found nothing to load"]
    opt = engine.optimizer
    if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    stage, t = engine.grid.get_stage_id(), engine.grid.get_slice_parallel_rank()
    problems = []
    checked = 0
    for n, q in engine.module.named_parameters():
        if n in frozen:
            got = {"lowp": q.data}
            if q.requires_grad or safe_get_full_fp32_param(q) is not None:
                problems.append(f"stage {stage} TP rank {t}: frozen {n} is in the optimizer")
        else:
            got = {**fp32_and_moments(engine, q), "lowp": q.data}
        for key, x in got.items():
            want = truth[f"tp{t}/{key}/{n}"] if tp == src_tp else megatron_pipe_slice(truth, key, n, src_tp, tp, t)
            if x is None or x.shape != want.shape or x.dtype != (want.dtype if key == "lowp" else x.dtype) or \
                    not torch.equal(x.to(want.dtype), want):
                problems.append(f"stage {stage} TP rank {t}: {key} of {n} differs from the truth")
            checked += 1
    base = engine.optimizer
    while hasattr(base, "optimizer"):
        base = base.optimizer
    steps = {float(st["step"]) for st in base.state.values() if "step" in st}
    if steps != {float(meta["steps"])}:
        problems.append(f"stage {stage} TP rank {t}: optimizer steps {sorted(steps)}, saved {meta['steps']}")
    if engine.global_steps != meta["global_steps"]:
        problems.append(f"global_steps {engine.global_steps}, saved {meta['global_steps']}")
    if checked == 0:
        problems.append(f"stage {stage} TP rank {t}: nothing checked")
    dp_rank = engine.grid.get_data_parallel_rank()
    micro = engine.gradient_accumulation_steps()
    batches = [am.make_batch(am.STEPS * micro + m, dp_rank, mm.VOCAB) for m in range(micro)]
    loss = engine.train_batch(data_iter=iter([(ids, ids.clone()) for ids in batches]))
    if not math.isfinite(float(loss)):
        problems.append(f"one more train_batch gave loss {float(loss)}")
    dist.barrier()
    return problems


report_checks(args.pairs, check_one, args.result)
