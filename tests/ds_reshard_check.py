"""Load resharded checkpoints with real DeepSpeed and check them against the source fixture's truth.

    DS_ACCELERATOR=cpu deepspeed --num_gpus N --master_port P tests/ds_reshard_check.py \
        --result out.json FIXTURE=RESHARDED_DIR [FIXTURE=RESHARDED_DIR ...]
    deepspeed --num_gpus N tests/ds_reshard_check.py --device cuda ...   # fp16 (see tests/gpu/)
    ... tests/ds_reshard_check.py --zero-stage 3 [--sub-group-size 40] ...  # a stage-converted checkpoint
    ... tests/ds_reshard_check.py FIXTURE@0=DIR ...   # this pair's target ZeRO stage (overrides --zero-stage)
    ... tests/ds_reshard_check.py FIXTURE:fp16=DIR ...   # a `reshard --dtype fp16` output (another precision)

For each pair: rebuild the fixture's model, param groups and ds_config (train_batch_size adapted to
N ranks; with ``--zero-stage`` the ZeRO stage, and ``--sub-group-size``, replaced by the target's),
``deepspeed.initialize``, plain ``engine.load_checkpoint(dir)``, then compare with
``truth.safetensors`` exactly:

* fp32 master + Adam moments through ``safe_get_full_fp32_param`` / ``safe_get_full_optimizer_state``
  (skipped under ``round_robin_gradients``, where DeepSpeed 0.19.8's fragment API mis-maps
  equal-size params), and for stage 1/2 also through the optimizer's own flat partitions gathered
  from every rank and cut at DeepSpeed's live param offsets;
* module (16-bit) weights, frozen params, buffers; Adam step, global_steps/samples, skipped_steps;

then run one more training step. A pair ``FIXTURE:DTYPE`` is a ``reshard --dtype DTYPE`` output: the engine is
built with that precision as the plan's ``resume with:`` line says (``"bf16": {"enabled": true}``,
``"fp16": {"enabled": true}`` or neither; no ``data_types.buffer_dtype``), masters and moments are compared with
the source's truth as above, module weights with the truth's masters cast to DTYPE (frozen params: their stored
copy cast), buffers with the truth's values (fp32 in the live module), and an fp16 target's loss scaler with a new
``DynamicLossScaler`` at 2**16 (``--expect-scale``). With ``--universal`` the directory is a universal checkpoint
(``latest_universal``) loaded with ``"checkpoint": {"load_universal": true}``; DeepSpeed 0.19.8's
universal loader restores only the optimizer's params, so frozen params (set to
:data:`FROZEN_SENTINEL` before ``deepspeed.initialize``) and buffers are checked to be exactly what the
engine held before ``load_checkpoint`` and different from the saved values: a change in DeepSpeed's
behaviour fails the check. Prints ``PASS name`` / ``FAIL name: why`` on rank 0 and writes a
JSON result list with ``--result``. Exit status 1 if anything failed.
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
p.add_argument("pairs", nargs="+", help="FIXTURE_NAME=RESHARDED_SAVE_DIR")
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
p.add_argument("--result", default=None)
p.add_argument("--fixtures", default=os.path.join(HERE, "fixtures"))
p.add_argument("--zero-stage", type=int, default=None, help="the target ZeRO stage (default: the fixture's)")
p.add_argument("--sub-group-size", type=int, default=None, help="ZeRO-3 sub_group_size of the target config")
p.add_argument("--force-cpu-fp16", action="store_true",
               help="let DeepSpeed's CPU accelerator run fp16 (as tests/fixtures/generate.py does for *_cpuforced)")
p.add_argument("--universal", action="store_true", help="the directories are universal checkpoints (load_universal)")
p.add_argument("--scale-state", action="store_true",
               help="fp16: also compare the loss scaler's whole state (dynamic, iteration, last overflow, window, "
                    "factor) with what 3 steps without overflow leave")
p.add_argument("--expect-scale", type=float, default=65536.0,
               help="FIXTURE:fp16 pairs: the loss scale the new dynamic scaler starts at")
args = p.parse_args()
FROZEN_SENTINEL = 0.25  # exact in bf16/fp16; never a trained value

if args.force_cpu_fp16:
    os.environ["DS_ACCELERATOR"] = "cpu"
    from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator

    CPU_Accelerator.is_fp16_supported = lambda self: True
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]

import deepspeed
from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_launch import gloo_only, report_checks
from safetensors.torch import load_file

gloo_only()  # no JIT C++ build of DeepSpeed's shm op (see tests/ds_launch.py)
if getattr(sys.modules.get("oneccl_bindings_for_pytorch"), "DSCKPT_STUB", False):
    # DeepSpeed <= 0.13 on CPU with tests/fixtures/old_ds_shim on PYTHONPATH: no 'ccl' backend, use gloo
    from deepspeed.accelerator import get_accelerator
    get_accelerator()._communication_backend_name = "gloo"
    if get_accelerator().current_stream() is None:
        # DeepSpeed 0.10.3's CPU accelerator has no streams (current_stream() is None), yet stage-3
        # load_checkpoint ends with an all-gather whose handle calls current_stream().synchronize()
        # (partition_parameters.py AllGatherCoalescedHandle.wait, from stage3.checkpoint_event_epilogue, after
        # every file was read): a CPU-only crash that no checkpoint content avoids. CPU work is synchronous,
        # so a no-op stream is exact.
        class _NoStream:
            def synchronize(self):
                pass

        type(get_accelerator()).current_stream = lambda self, device_index=None: _NoStream()

deepspeed.init_distributed()
rank = dist.get_rank()
world = dist.get_world_size()
if args.device == "cuda":
    torch.cuda.set_device(args.local_rank % torch.cuda.device_count())
    dev = torch.device("cuda", torch.cuda.current_device())
else:
    dev = torch.device("cpu")


from deepspeed.comm import comm as ds_comm

NATIVE_ALL_GATHER = ds_comm.cdb.all_gather_function


def use_gloo_safe_all_gather(stage):
    """Some (DeepSpeed, torch) pairs cannot all_gather_into_tensor over gloo after a partitioned step; on CPU
    take DeepSpeed's own dist.all_gather fallback there (fixture_models.GLOO_ALL_GATHER_FALLBACK says why)."""
    fallback = dev.type == "cpu" and fm.needs_gloo_all_gather_fallback(deepspeed.__version__, torch.__version__, stage)
    ds_comm.cdb.all_gather_function = None if fallback else NATIVE_ALL_GATHER


def build(name, zero_stage=None, dtype=None):
    spec = dict(fm.FIXTURES[name])
    cfg = fm.ds_config(spec)
    if dtype is not None:  # the precision block the reshard plan says to resume with
        for k in ("bf16", "fp16", "data_types"):
            cfg.pop(k, None)
        if dtype != "fp32":
            cfg[dtype] = {"enabled": True}
    if zero_stage is not None:
        spec["stage"] = zero_stage
        cfg["zero_optimization"] = {**cfg["zero_optimization"], "stage": zero_stage}
    if args.sub_group_size is not None:
        cfg["zero_optimization"]["sub_group_size"] = args.sub_group_size
    use_gloo_safe_all_gather(spec["stage"])
    cfg["train_batch_size"] = fm.MICRO_BATCH * cfg.get("gradient_accumulation_steps", 1) * world
    if spec.get("nvme"):
        # NVMe swap files are named by ds_id, which ZeRO-3 numbers from a process-wide counter
        # (partition_parameters.Init.param_id): a fresh training process starts at 0, this script's second
        # engine would not. Start every NVMe engine where a resuming process does.
        from deepspeed.runtime.zero.partition_parameters import Init
        Init.param_id = 0
    model = fm.build_model(spec).to(dev)
    if args.universal:
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
        with torch.no_grad():
            for q in model.parameters():
                if not q.requires_grad:
                    q.fill_(FROZEN_SENTINEL)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=fm.model_parameters(model, spec), config=cfg)
    return spec, cfg, engine


def gather_flat(t):
    parts = [torch.empty_like(t) for _ in range(world)]
    dist.all_gather(parts, t.contiguous())
    return torch.cat(parts)


def _dense_offsets(groups):
    offsets = []
    for g in groups:
        o, acc = [], 0
        for q in g:
            o.append(acc)
            acc += q.numel()
        offsets.append(o)
    return offsets


def check_flat_partitions(engine, truth, problems):
    """Stage 1/2 and BF16_Optimizer: the optimizer's own fp32 partitions and Adam moments."""
    opt = engine.optimizer
    inner = opt.optimizer
    if hasattr(opt, "round_robin_bit16_groups"):
        groups = opt.round_robin_bit16_groups
        # round_robin_bit16_offsets (alignment padding) is newer than DeepSpeed 0.10.3, which packs params densely
        offsets = getattr(opt, "round_robin_bit16_offsets", None) or _dense_offsets(groups)
        flats = opt.single_partition_of_fp32_groups
    else:  # BF16_Optimizer: bf16_groups order, no alignment padding
        groups = opt.bf16_groups
        offsets = _dense_offsets(groups)
        flats = opt.fp32_groups_flat_partition
    for gi, (plist, offs, part) in enumerate(zip(groups, offsets, flats)):
        full = {"param": gather_flat(part.detach().float())}
        st = inner.state[part]
        for key in ("exp_avg", "exp_avg_sq"):
            full[key] = gather_flat(st[key].detach().float())
        for q, off in zip(plist, offs):
            n = engine.param_names[q]
            for key, flat in full.items():
                got = flat[off:off + q.numel()].view(q.shape).cpu()
                if not torch.equal(got, truth[f"{key}/{n}"]):
                    problems.append(f"flat partition {key} of '{n}' (group {gi}) differs from the source")


def check_stage0_masters(engine, truth, problems):
    """Stage-0 FP16_UnfusedOptimizer / FP16_Optimizer: each fp32 master and its Adam moments."""
    opt = engine.optimizer
    base = opt.optimizer
    name_of = {id(q): n for n, q in engine.module.named_parameters()}
    if hasattr(opt, "fp32_groups_flat"):  # fused: one flat master per group, params packed in order
        pairs = []
        for plist, flat in zip(opt.fp16_groups, opt.fp32_groups_flat):
            st, off = base.state[flat], 0
            for q in plist:
                k = q.numel()
                pairs.append((q, {"param": flat.data[off:off + k], "exp_avg": st["exp_avg"][off:off + k],
                                  "exp_avg_sq": st["exp_avg_sq"][off:off + k]}))
                off += k
    else:
        pairs = [(q, {"param": m.data, "exp_avg": base.state[m]["exp_avg"], "exp_avg_sq": base.state[m]["exp_avg_sq"]})
                 for plist, masters in zip(opt.fp16_groups, opt.fp32_groups) for q, m in zip(plist, masters)]
    for q, got in pairs:
        n = name_of[id(q)]
        for key, t in got.items():
            if not torch.equal(t.detach().float().cpu().view(q.shape), truth[f"{key}/{n}"]):
                problems.append(f"stage-0 {key} of '{n}' differs from the source")


def check_universal_leaves_alone(meta, truth, lowp, buffers_before, buffers_after, problems):
    """DeepSpeed 0.19.8's universal load restores no frozen param and no buffer (it skips
    load_module_state_dict, engine.py _load_checkpoint, and only visits the optimizer's params): each is
    exactly what the engine held before load_checkpoint, and differs from the saved value."""
    for n in meta["frozen"]:
        got = lowp[n].float()
        if not torch.all(got == FROZEN_SENTINEL):
            problems.append(f"frozen param '{n}' was changed by the universal load (DeepSpeed now restores frozen "
                            "params? update README 'Universal checkpoints')")
        if torch.equal(got, truth[f"param/{n}"]):
            problems.append(f"frozen param '{n}' already held the saved value: the check proves nothing")
    for n in meta["buffers"]:
        after = buffers_after[n].detach().cpu()
        if not torch.equal(after, buffers_before[n]):
            problems.append(f"buffer '{n}' was changed by the universal load (DeepSpeed now restores buffers? update "
                            "README 'Universal checkpoints')")
        if torch.equal(after.to(truth[f"buffer/{n}"].dtype), truth[f"buffer/{n}"]):
            problems.append(f"buffer '{n}' already held the saved value: the check proves nothing")
        if rank == 0:
            print(f"UNIVERSAL-EVIDENCE {meta['name']}: buffer {n} after load {after.flatten()[:3].tolist()} "
                  f"(saved {truth[f'buffer/{n}'].flatten()[:3].tolist()})", flush=True)


def one_more_step(engine, meta, problems):
    """One more training step on this rank's next batch: the loss is finite and global_steps moves on by one."""
    ids, tgt = fm.make_batch(fm.STEPS, rank)
    loss = F.cross_entropy(engine(ids.to(dev)).float(), tgt.to(dev))
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss):
        problems.append(f"loss after resume is {float(loss)}")
    if engine.global_steps != meta["global_steps"] + 1:
        problems.append(f"global_steps after one more step: {engine.global_steps}")


def check_optim(name, ckpt_dir):
    """An optimizer fixture (``optim/<name>``, tests/fixtures/generate_optim.py): its model, groups and config on
    this many ranks, plain ``load_checkpoint``; then every per-element state tensor of every param (the fragment
    API; Muon's ZeRO-1/2 momentum from each rank's buffer), the fp32 masters, each group's step and
    hyper-parameters, global_steps, exactly; then one more step."""
    import generate_optim as go

    fdir = os.path.join(args.fixtures, name)
    meta = json.load(open(os.path.join(fdir, "truth.json")))
    truth = load_file(os.path.join(fdir, "truth.safetensors"))
    spec = go.OPTIM_FIXTURES[meta["name"]]
    stage = args.zero_stage if args.zero_stage is not None else meta["stage"]
    cfg = json.loads(json.dumps(meta["config"]))
    cfg["zero_optimization"]["stage"] = stage
    cfg["train_batch_size"] = fm.MICRO_BATCH * world
    if args.universal:  # the checks below read what the universal loader restores: masters, states, steps
        cfg["checkpoint"] = {**cfg.get("checkpoint", {}), "load_universal": True}
    use_gloo_safe_all_gather(stage)
    model = fm.build_model({}).to(dev)
    go.tag_muon(model, spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=go.model_parameters(model, spec), config=cfg)
    load_path, _ = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint returned None for {ckpt_dir}"]
    problems = []
    opt, base = engine.optimizer, go.innermost(engine.optimizer)
    if stage in (1, 2):
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    params = dict(engine.module.named_parameters())
    name_of = {id(q): n for n, q in params.items()}
    muon = go.muon_momentum(opt, base, stage, name_of)
    keys = {n: g["state_keys"] for g in meta["groups"] for n in g["names"]}
    checked = 0
    for n in meta["trainable"]:
        q = params[n]
        got = {"param": safe_get_full_fp32_param(q)}
        for k in keys[n]:
            got[k] = muon.get(n) if k == "momentum_buffer" and n in muon else safe_get_full_optimizer_state(q, k)
        for k, t in got.items():
            # values exactly; not the dtype: torch's Optimizer.load_state_dict casts a restored state to its
            # param's (the fp32 flat partition's), as Muon's bf16 momentum at ZeRO-2 is after any resume
            want = truth[f"{k}/{n}"]
            if t is None or not torch.equal(t.detach().cpu().float(), want.float()):
                problems.append(f"{k} of '{n}' differs from the source")
            checked += 1
    if checked <= len(meta["trainable"]):
        problems.append(f"only {checked} tensors compared: the check proves nothing")
    flats = go.flat_groups(opt, stage)

    def group_step(g):
        if stage == 3:  # stage3.py steps each sub-group with 'params' = [its flat], then empties it
            firsts = [f for i, f in enumerate(flats) if opt.sub_group_to_group_id[i] == g]
        else:
            firsts = [f for f in flats if any(f is x for x in base.param_groups[g]["params"])]
        st = base.state[firsts[0]] if firsts else {}
        return float(st["step"]) if "step" in st else None

    for g, want in enumerate(meta["groups"]):
        if group_step(g) != (float(want["step"]) if want["step"] is not None else None):
            problems.append(f"group {g} step {group_step(g)} != {want['step']}")
        for k, v in want["hyperparams"].items():
            if k in base.param_groups[g] and go.jsonable(base.param_groups[g][k]) != v:
                problems.append(f"group {g} {k} {base.param_groups[g][k]!r} != {v!r}")
    if engine.global_steps != meta["global_steps"]:
        problems.append(f"global_steps {engine.global_steps} != {meta['global_steps']}")
    before = [group_step(g) for g in range(len(meta["groups"]))]
    one_more_step(engine, meta, problems)
    after = [group_step(g) for g in range(len(meta["groups"]))]
    if [None if b is None else b + 1 for b in before] != after:
        problems.append(f"group steps after one more step: {after} (before {before})")
    return problems


def check_one(name, ckpt_dir):
    if name.startswith("optim/"):
        return check_optim(name, ckpt_dir)
    problems = []
    name, _, pair_stage = name.partition("@")
    name, _, dtype = name.partition(":")
    dtype = dtype or None
    spec, cfg, engine = build(name, int(pair_stage) if pair_stage else args.zero_stage, dtype)
    meta = json.load(open(os.path.join(args.fixtures, name, "truth.json")))
    truth = load_file(os.path.join(args.fixtures, name, "truth.safetensors"))
    stage = spec["stage"]
    if args.universal:
        buffers_before = {n: b.detach().cpu().clone() for n, b in engine.module.named_buffers()}
    load_path, client = engine.load_checkpoint(ckpt_dir)
    if load_path is None:
        return [f"load_checkpoint returned None for {ckpt_dir}"]
    module = engine.module
    opt = engine.optimizer
    # DeepSpeed 0.10.3-0.16.9 wrap stage-0 bf16 in BF16_Optimizer: partitioned like ZeRO-1, with the fragment API
    bf16_opt = type(opt).__name__ == "BF16_Optimizer"
    if (stage in (1, 2) or bf16_opt) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # Link the optimizer-state fragments for the fragment API (the fixture generator does the same). DeepSpeed
        # links them lazily at the first step; BF16_Optimizer.load_state_dict (0.14.5, 0.16.9) re-links the params
        # with no optimizer state, so before a step safe_get_full_optimizer_state fails on optim_fragment None.
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    round_robin = bool(cfg["zero_optimization"].get("round_robin_gradients"))
    params = dict(module.named_parameters())
    for n in meta["trainable"]:
        if n in meta["tied"]:
            continue
        q = params[n]
        if stage == 0 and not bf16_opt:
            continue
        if not round_robin:
            got = {"param": safe_get_full_fp32_param(q)}
            if not spec.get("nvme"):  # see NVME-EVIDENCE below: a fresh NVMe engine has no moments to show
                got["exp_avg"] = safe_get_full_optimizer_state(q, "exp_avg")
                got["exp_avg_sq"] = safe_get_full_optimizer_state(q, "exp_avg_sq")
            for key, t in got.items():
                if t is None or not torch.equal(t.detach().float().cpu(), truth[f"{key}/{n}"]):
                    problems.append(f"{key} of '{n}' differs from the source (fragment API)")
    if stage in (1, 2) or bf16_opt:
        check_flat_partitions(engine, truth, problems)
    if stage == 0 and not bf16_opt and hasattr(opt, "fp32_groups"):
        check_stage0_masters(engine, truth, problems)
    # module weights, frozen params, buffers
    if stage == 3:
        with deepspeed.zero.GatheredParameters(list(module.parameters())):
            lowp = {n: q.data.detach().cpu().clone() for n, q in params.items()}
    else:
        lowp = {n: q.data.detach().cpu().clone() for n, q in params.items()}
    cast = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}.get(dtype)
    for n, t in lowp.items():
        key = f"lowp/{n}"
        if args.universal and n in meta["frozen"]:
            continue  # not restored by a universal load: check_universal_leaves_alone
        if cast is not None:  # another precision: the master cast (round to nearest even); a frozen param's copy
            want = (truth[key] if n in meta["frozen"] else truth[f"param/{n}"]).to(cast)
            if t.dtype != cast or not torch.equal(t, want):
                problems.append(f"module weight '{n}' ({t.dtype}) is not the source's cast to {cast}")
        elif key in truth and not torch.equal(t, truth[key]):
            problems.append(f"module weight '{n}' differs from the source")
    if args.universal:
        check_universal_leaves_alone(meta, truth, lowp, buffers_before, dict(module.named_buffers()), problems)
    for n in meta["frozen"] if not args.universal else ():
        want = truth[f"param/{n}"] if cast is None else truth[f"lowp/{n}"].to(cast).float()
        if not torch.equal(lowp[n].float(), want):
            problems.append(f"frozen param '{n}' differs from the source")
    buffers = dict(module.named_buffers())
    expected_buffers = {n: truth[f"buffer/{n}"] for n in meta["buffers"]}
    if stage == 3 and meta["stage"] == 3:
        # Stage-3 ranks keep their own (unsynchronised) BatchNorm statistics; dsckpt keeps source rank r's
        # for r < source world size and gives new ranks rank 0's. truth.safetensors holds rank 0's.
        from dsckpt import safe_load
        src_rank = rank if rank < meta["dp_world_size"] else 0
        src = safe_load.load(os.path.join(args.fixtures, name, "ckpt", meta["tag"],
                                          f"zero_pp_rank_{src_rank}_mp_rank_00_model_states.pt"))
        expected_buffers = {n: src["module"][n].load() for n in meta["buffers"]}
    for n in meta["buffers"] if not args.universal else ():
        got = buffers[n].detach().cpu()
        if cast is not None and got.is_floating_point():  # the live module's buffers (fp32): the values widened
            if got.dtype != torch.float32 or not torch.equal(got, expected_buffers[n].float()):
                problems.append(f"buffer '{n}' ({got.dtype}) differs from the source")
        elif not torch.equal(got, expected_buffers[n]):
            problems.append(f"buffer '{n}' differs from the source")
    # counters
    if engine.global_steps != meta["global_steps"]:
        problems.append(f"global_steps {engine.global_steps} != {meta['global_steps']}")
    if engine.global_samples != meta["global_samples"]:
        problems.append(f"global_samples {engine.global_samples} != {meta['global_samples']}")
    if engine.skipped_steps != meta["skipped_steps"]:
        problems.append(f"skipped_steps {engine.skipped_steps} != {meta['skipped_steps']}")
    base = opt
    while hasattr(base, "optimizer"):
        base = base.optimizer
    want_step = meta["optimizer_step"][0] if meta["optimizer_step"] else None
    steps = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if spec.get("nvme"):
        # DeepSpeed 0.19.8's NVMe load reads no optimizer file (engine.py load_checkpoint skips
        # _load_zero_checkpoint): the step is not restored, whatever the files hold. Shown, and then expected.
        if rank == 0:
            print(f"NVME-EVIDENCE {name}: Adam step after load_checkpoint {steps} (saved {want_step}); swap folder "
                  f"{sorted(os.listdir(engine.optimizer.optimizer_swapper.swap_folder))}", flush=True)
        want_step = steps[0] if len(steps) == 1 else None
    if want_step is not None and steps != [want_step]:
        problems.append(f"Adam step {steps} != {want_step}")
    if args.universal and stage == 3:
        # DeepSpeed 0.19.8 stage3.py load_hp_checkpoint_state_from_checkpoint_dir_stage3 puts the one step tensor
        # of optimizer_state.pt into every sub-group's Adam state; torch's Adam increments it in place, once per
        # sub-group and step. Proven here, then worked around as the README says (one tensor per sub-group).
        states = [st for st in base.state.values() if "step" in st]
        shared = len(states) > 1 and len({id(st["step"]) for st in states}) == 1
        if len(states) > 1 and not shared:
            problems.append("ZeRO-3 sub-groups no longer share one Adam step tensor after a universal load "
                            "(DeepSpeed fixed it? update README 'Universal checkpoints')")
        if rank == 0:
            print(f"UNIVERSAL-EVIDENCE {name}: {len(states)} ZeRO-3 sub-groups, one shared step tensor: {shared}",
                  flush=True)
        for st in states:
            st["step"] = st["step"].clone()
    if dtype is not None:
        scaler = getattr(opt, "loss_scaler", None)
        kind = type(scaler).__name__
        if dtype == "fp16":
            got = {k: getattr(scaler, k, None) for k in ("cur_scale", "cur_iter", "last_overflow_iter",
                                                         "cur_hysteresis")}
            want = {"cur_scale": args.expect_scale, "cur_iter": 0, "last_overflow_iter": -1, "cur_hysteresis": 2}
            if kind != "DynamicLossScaler" or got != want:
                problems.append(f"loss scaler {kind} {got} != a new DynamicLossScaler {want}")
        elif scaler is not None and (kind != "LossScaler" or float(scaler.cur_scale) != 1.0):
            problems.append(f"loss scaler {kind} in a {dtype} engine")
        if rank == 0:
            print(f"DTYPE-EVIDENCE {name}:{dtype}: {type(opt).__name__}, loss scaler {kind}"
                  + (f" at {scaler.cur_scale}" if scaler is not None else "")
                  + f", module dtype {next(iter(lowp.values())).dtype}", flush=True)
    elif meta.get("loss_scale") is not None:
        scale = float(getattr(opt, "cur_scale", getattr(opt, "loss_scale", 0.0)))
        if scale != float(meta["loss_scale"]):
            problems.append(f"loss scale {scale} != {meta['loss_scale']}")
        if args.scale_state:
            # ZeRO keeps a DynamicLossScaler, the stage-0 wrappers a LossScaleConfig: the same fields
            scaler = getattr(opt, "loss_scaler", None) or opt.loss_scale_config
            got = {k: getattr(scaler, k, None) for k in ("cur_iter", "last_overflow_iter", "scale_window",
                                                         "scale_factor")}
            got["dynamic"] = bool(getattr(scaler, "dynamic", getattr(scaler, "dynamic_loss_scale", False)))
            want = {"cur_iter": meta["global_steps"], "last_overflow_iter": -1, "scale_window": 1000,
                    "scale_factor": 2.0, "dynamic": True}  # 3 steps from 2**8, no overflow (skipped_steps 0)
            if got != want:
                problems.append(f"loss scaler state {got} != {want}")
    if engine.lr_scheduler is not None or client.get("lr_scheduler") is not None:
        problems.append("unexpected lr scheduler state")
    lrs = sorted({g["lr"] for g in base.param_groups})
    if lrs != [cfg["optimizer"]["params"]["lr"]]:
        problems.append(f"learning rates {lrs} != config")
    # one more step
    one_more_step(engine, meta, problems)
    steps_after = sorted({float(s["step"]) for s in base.state.values() if "step" in s})
    if spec.get("nvme"):
        # DeepSpeed 0.19.8's NVMe swapper knows only the fp32 master of each sub-group until torch's Adam creates
        # its state at the first step (stage3.py initialize_optimizer_states no longer steps): load_checkpoint
        # copies offloaded_tensors/rankNN into the swap folder, the masters are swapped in from it, and the first
        # step starts the moments from zero. Proven here after that step: fresh moments satisfy
        # exp_avg**2 * (1 - beta2) == exp_avg_sq * (1 - beta1)**2 (both made from one gradient).
        b1, b2 = base.param_groups[0].get("betas", (0.9, 0.999))
        fresh = []
        for n in meta["trainable"]:
            if n in meta["tied"]:
                continue
            m = safe_get_full_optimizer_state(params[n], "exp_avg").double()
            v = safe_get_full_optimizer_state(params[n], "exp_avg_sq").double()
            fresh.append(bool(torch.allclose(m * m * (1 - b2), v * (1 - b1) ** 2, rtol=1e-4, atol=1e-30)))
        if rank == 0:
            print(f"NVME-EVIDENCE {name}: moments after the first step after load_checkpoint are made from that "
                  f"step's gradient alone: {sum(fresh)} of {len(fresh)} params", flush=True)
        if not all(fresh):
            problems.append(f"NVMe: {len(fresh) - sum(fresh)} of {len(fresh)} params' moments after one step "
                            "carry saved state (DeepSpeed now restores NVMe moments? check them before the step)")
    if want_step is not None and steps_after != [want_step + 1]:
        problems.append(f"Adam step after one more step: {steps_after}")
    engine.destroy() if hasattr(engine, "destroy") else None
    return problems


report_checks(args.pairs, check_one, args.result)
