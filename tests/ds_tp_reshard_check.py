"""Load resharded tensor-parallel checkpoints with real DeepSpeed (AutoTP) and check them against the fixture's truth.

    DS_ACCELERATOR=cpu deepspeed --num_gpus N tests/ds_tp_reshard_check.py --tp-size T [--zero-stage S] \
        --result out.json FIXTURE=RESHARDED_DIR [FIXTURE=RESHARDED_DIR ...]

For each pair: the fixture's model (``tests/fixtures/autotp_models.py``, same seed) and ds_config, with
``"tensor_parallel": {"autotp_size": T}`` (no TP section at T = 1; DeepSpeed derives ``train_batch_size`` for the
N / T data-parallel ranks) and, with ``--zero-stage``, that ZeRO stage; ``deepspeed.init_distributed("gloo")``, ``deepspeed.initialize``,
plain ``engine.load_checkpoint(dir)``. ``megatron_*`` fixtures are rebuilt as generate_autotp.py built them: this TP
rank's ``tp_megatron_models.MegatronNet`` (padded vocabulary: its local slices hold the padding rows) and its
``MPU(T)`` passed to ``deepspeed.initialize`` (no AutoTP); ``NAME@padded`` at T = 1: the model with its vocabulary
still padded to 32 rows (``--make-vocab-size-divisible-by 16`` at TP 1; the padding rows expected zero). With
``--universal`` the directories are ``reshard --universal`` folders, loaded with ``"checkpoint": {"load_universal":
true}`` (a padded vocabulary's padding rows are then expected zero: DeepSpeed's universal loader re-pads the cut
vocabulary with zeros). Then, against ``truth.safetensors`` (what the source engine returned), exactly:

* per param, ``safe_get_full_fp32_param`` and ``safe_get_full_optimizer_state(exp_avg / exp_avg_sq)`` -- at the
  source's TP size each TP rank's local slice (``tp{t}/...``), at T = 1 the full tensor (``param/...``), at another
  T > 1 the full tensor cut by DeepSpeed's own ``_partition_logical_tensor`` at the live layer's widths
  (:func:`expected`; ``megatron_*``: cut in equal parts over the zero-padded vocabulary, :func:`megatron_slice`);
* the module's (16-bit) weights (``tp{t}/lowp/...`` / ``lowp/...``; frozen params (truth.json ``frozen``) are
  frozen in the loading model too and have no optimizer state), buffers (truth.json ``buffers``), Adam's step, global
  steps and samples;
  where truth.json records them (the fp16 fixtures), skipped steps and the loss scaler's state (class, scale,
  iteration, last overflow, hysteresis, ...); fp16 fixtures run with DeepSpeed's CPU-fp16 refusal patched out, as
  they were made (:func:`forced_cpu_fp16`);
* the logits of ``autotp_models.eval_ids`` against the engine logits recorded on the machine that made the fixture.
  They are computed here by another CPU's kernels, so never compared bit for bit (on the recording machine they were
  equal at the source's TP size): within ``logits_slack`` (1e-5 for fp32 runs; two bf16 ulps of the largest logit
  for bf16 runs, whose logits are bf16). At another TP size the TP all-reduce also sums in another order, so the
  difference phase 1 recorded for the fixture is added (``--logits-atol`` overrides it; ``truth.json`` crosscheck
  ``merged_fp32_logits``: 2.98e-8 for fp32 runs, 9.8e-4-1.95e-3 for bf16 runs);

then one more training step, whose loss must be finite. Prints ``PASS`` / ``FAIL`` lines on rank 0 and writes the
JSON result list (:func:`ds_launch.report_checks`); rank 0 also prints ``LOGITS name: max |diff|`` per checkpoint.
"""
import argparse
import contextlib
import os
import sys

import torch
import torch.distributed as dist

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(HERE, "fixtures"))
import autotp_models as am

p = argparse.ArgumentParser()
p.add_argument("pairs", nargs="+", help="FIXTURE_NAME=RESHARDED_SAVE_DIR")
p.add_argument("--local_rank", type=int, default=int(os.environ.get("LOCAL_RANK", 0)))
p.add_argument("--result", default=None)
p.add_argument("--fixtures", default=os.path.join(HERE, "fixtures", "autotp"))
p.add_argument("--tp-size", type=int, required=True)
p.add_argument("--zero-stage", type=int, default=None)
p.add_argument("--universal", action="store_true",
               help='the directories are universal folders (reshard --universal), loaded with "load_universal": the '
                    "padding rows of a padded vocabulary are expected zero (DeepSpeed's loader pads with zeros)")
p.add_argument("--logits-atol", type=float, default=None,
               help="allowed max |logit difference| at another TP size (default: what phase 1 recorded for the fixture: "
                    "a plain model loaded with DeepSpeed's merged fp32, run in the fixture's dtype)")
args = p.parse_args()


import deepspeed
from deepspeed.accelerator.cpu_accelerator import CPU_Accelerator
from deepspeed.utils import groups, safe_get_full_fp32_param, safe_get_full_optimizer_state
from ds_launch import gloo_only, logits_slack, report_checks
from safetensors.torch import load_file

gloo_only()
deepspeed.init_distributed("gloo")
world = dist.get_world_size()
TP = args.tp_size


@contextlib.contextmanager
def forced_cpu_fp16(on: bool):
    """fp16 fixtures (``device: cpu-forced-fp16``, generate_autotp.py): DeepSpeed's CPU accelerator refuses fp16
    ("Type fp16 is not supported on your device", engine.py:2003) and leaves float16 out of ``supported_dtypes``
    (gradient reduction, engine.py:169), so both are patched as the fixture's run patched them -- for this fixture's
    initialize, load, checks and extra step only; the other fixtures of the launch run unpatched."""
    if not on:
        yield
        return
    saved = CPU_Accelerator.is_fp16_supported, CPU_Accelerator.supported_dtypes
    CPU_Accelerator.is_fp16_supported = lambda self: True
    CPU_Accelerator.supported_dtypes = lambda self: [torch.float, torch.bfloat16, torch.float16]
    try:
        yield
    finally:
        CPU_Accelerator.is_fp16_supported, CPU_Accelerator.supported_dtypes = saved


def build(name, padded=False, dtype=None):
    """``(spec, engine, tp_rank, dp_rank)`` of the fixture's model at TP size ``TP`` (``padded``: a Megatron-style
    model whose vocabulary stays padded at TP 1)."""
    spec = dict(am.AUTOTP_FIXTURES.get(name) or am.AUTOTP_FAILED[name])  # a failed one: made with --out elsewhere
    spec["tp"] = TP
    if args.zero_stage is not None:
        spec["stage"] = args.zero_stage
    if dtype:  # a `reshard --dtype` output: the engine built with the target's precision (DeepSpeed's defaults)
        spec["dtype"] = dtype
        spec["ds_extra"] = {k: v for k, v in spec.get("ds_extra", {}).items() if k != "data_types"}
    cfg = am.ds_config(spec)
    if TP == 1:
        cfg.pop("tensor_parallel", None)
    if args.universal:
        cfg["checkpoint"] = {"load_universal": True}
    if spec["arch"] == "megatron":  # as generate_autotp.py: this TP rank's slices + an mpu, no AutoTP
        import tp_megatron_models as mm

        mpu = mm.MPU(TP)
        model = mm.MegatronNet(mpu.tp_group, mpu.tp_rank, TP, padded_at_tp1=padded, gqa=spec.get("gqa", False))
        engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg, mpu=mpu)
        return spec, engine, mpu.get_tensor_model_parallel_rank(), mpu.get_data_parallel_rank()
    model = am.with_frozen_and_buffer(am.make_model(spec["arch"]), spec)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(), config=cfg)
    if TP == 1:
        return spec, engine, 0, dist.get_rank()
    return spec, engine, groups.get_tensor_model_parallel_rank(), groups.get_data_parallel_rank()


def expected(truth, key, n, q, tp_rank, same_tp, megatron, padded=False):
    """What the engine must hold for ``key`` of param ``n`` (live param ``q``): the recorded TP-local slice at the
    source's TP size, the full tensor at TP 1, and at another TP size > 1 the full (merged) truth cut by DeepSpeed
    itself: the live param's AutoTP metadata (its partition dim and frozen partition sizes / sub-param widths) through
    AutoTP's own ``_partition_logical_tensor`` -- independent of dsckpt's width rule. From a universal folder the
    padding rows of a padded vocabulary are zeros (DeepSpeed's universal loader re-pads what ds_to_universal cut,
    checkpoint/universal_checkpoint.py load_hp_checkpoint_state)."""
    want = truth[f"tp{tp_rank}/{key}/{n}" if same_tp else f"{key}/{n}"]
    if args.universal and megatron and same_tp and n in ("embed.weight", "head.weight"):
        import tp_megatron_models as mm

        want = want.clone()
        want[max(0, mm.VOCAB - tp_rank * want.shape[0]):] = 0
    if megatron and not same_tp and (TP > 1 or padded):
        return megatron_slice(want, n, tp_rank)
    if same_tp or TP == 1:
        return want
    from deepspeed.checkpoint.constants import DS_AUTOTP_UC_META
    from deepspeed.module_inject.layers import _partition_logical_tensor

    m = getattr(q, DS_AUTOTP_UC_META, None)
    if not m or m.get("replicated") or m.get("partition_dim") is None:
        return want
    dim = m["partition_dim"]
    widths = m.get("sub_param_shard_widths") or [list(m["partition_sizes"])]
    return _partition_logical_tensor(want, dim, TP, groups.get_tensor_model_parallel_rank(), widths,
                                     subparam_sizes=m.get("sub_param_sizes")).contiguous()


def megatron_slice(full, n, tp_rank):
    """TP rank ``tp_rank``'s slice of a Megatron-style param at TP size ``TP`` from its full (unpadded) tensor, cut as
    ``MegatronNet`` cuts its initial weights and as DeepSpeed's universal loader cuts a ds_to_universal tensor
    (``load_hp_checkpoint_state``): the vocabulary zero-padded to the model's ``PADDED_VOCAB`` rows, then
    ``torch.chunk`` on the split dim, each of a fused param's 2 sub-params apart; replicated params whole. A
    reshard to another TP size must give the same (its new padding rows are zeros, the old ones dropped)."""
    import tp_megatron_models as mm

    m = mm.tp_meta(n, TP)
    dim = m["partition_dim"]
    if dim is None:
        return full
    if m.get("vocabulary"):
        full = torch.nn.functional.pad(full, (0, 0, 0, mm.PADDED_VOCAB - full.shape[0]))
    if m.get("sub_param_shard_widths"):
        return torch.cat([p.chunk(TP, dim=dim)[tp_rank] for p in full.chunk(2, dim=dim)], dim=dim)
    return full.chunk(TP, dim=dim)[tp_rank]


def check_one(name, ckpt_dir):
    import json

    name, _, dtype = name.partition(":")  # NAME:DTYPE: a `reshard --dtype DTYPE` output
    name, _, variant = name.partition("@")
    with open(os.path.join(args.fixtures, name, "truth.json")) as f:
        meta = json.load(f)
    with forced_cpu_fp16("fp16" in (meta["dtype"], dtype)):
        return _check_one(name, ckpt_dir, meta, padded=variant == "padded", dtype=dtype or None)


TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def _check_one(name, ckpt_dir, meta, padded=False, dtype=None):
    problems = []
    truth = load_file(os.path.join(args.fixtures, name, "truth.safetensors"))
    spec, engine, tp_rank, dp_rank = build(name, padded, dtype)
    megatron = spec["arch"] == "megatron"
    same_tp = TP == meta["tp_size"]
    path, _ = engine.load_checkpoint(ckpt_dir)
    if path is None:
        return [f"load_checkpoint found nothing in {ckpt_dir}"]
    opt = engine.optimizer
    if spec["stage"] in (1, 2) and hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
        # DeepSpeed links the optimizer-state fragments lazily at the first step (as ds_reshard_check.py does)
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()
    # Without ZeRO the API returns None: read the live optimizer as generate_autotp.py recorded it.
    stage0 = am.stage0_views(engine) if spec["stage"] == 0 else None

    def full_state(q, key):
        if stage0 is not None:
            return stage0[id(q)][key]
        return safe_get_full_fp32_param(q) if key == "param" else safe_get_full_optimizer_state(q, key)

    for n, q in engine.module.named_parameters():
        if q.requires_grad != (n not in meta.get("frozen", ())):
            problems.append(f"'{n}' is {'not ' if q.requires_grad else ''}frozen in the loading model")
        for key in ("param", "exp_avg", "exp_avg_sq") if q.requires_grad else ():  # a frozen param: no hp state
            got = full_state(q, key)
            want = expected(truth, key, n, q, tp_rank, same_tp, megatron, padded)
            if got is None or tuple(got.shape) != tuple(want.shape) or not torch.equal(got.float().cpu(), want):
                problems.append(f"{key} of '{n}' differs from the source"
                                + (f" (shape {list(got.shape)}, expected {list(want.shape)})"
                                   if got is not None and tuple(got.shape) != tuple(want.shape) else ""))
        if spec["stage"] == 3:
            with deepspeed.zero.GatheredParameters([q]):
                lowp = q.data.detach().cpu().clone()
        else:
            lowp = q.data.detach().cpu()
        if dtype:  # the 16-bit copy is the master cast (a frozen param: its stored copy cast), bit for bit
            want = expected(truth, "param" if q.requires_grad else "lowp", n, q, tp_rank, same_tp, megatron,
                            padded).to(TORCH_DTYPES[dtype])
            if lowp.dtype != want.dtype or tuple(lowp.shape) != tuple(want.shape) or not torch.equal(lowp, want):
                problems.append(f"module weight '{n}' is not its master cast to {want.dtype}")
            continue
        want = expected(truth, "lowp", n, q, tp_rank, same_tp, megatron, padded)
        if tuple(lowp.shape) != tuple(want.shape) or not torch.equal(lowp.to(want.dtype), want):
            problems.append(f"module weight '{n}' differs from the source")
    for n in meta.get("buffers", ()):
        # load_universal restores no buffer (nor frozen param): these keep the model's seeded init, which the source
        # run never changed either -- checked so that the load leaves them intact
        want = truth[f"tp{tp_rank}/buffer/{n}" if same_tp else f"buffer/{n}"]
        if not torch.equal(engine.module.get_buffer(n).detach().cpu().float(), want.float()):
            problems.append(f"buffer '{n}' differs from the source")
    if engine.global_steps != meta["global_steps"] or engine.global_samples != meta["global_samples"]:
        problems.append(f"global steps/samples {engine.global_steps}/{engine.global_samples} != "
                        f"{meta['global_steps']}/{meta['global_samples']}")
    if "skipped_steps" in meta and engine.skipped_steps != meta["skipped_steps"]:
        problems.append(f"skipped steps {engine.skipped_steps} != {meta['skipped_steps']}")
    if dtype:  # the scaler DeepSpeed starts for the target (ds_writers/precision.py new_loss_scaler)
        sc = getattr(opt, "loss_scaler", None)
        got = (type(sc).__name__, float(sc.cur_scale), getattr(sc, "cur_iter", None)) if sc is not None else None
        want = ("DynamicLossScaler", 65536.0, 0) if dtype == "fp16" else ("LossScaler", 1.0, None)
        if got != want:
            problems.append(f"loss scaler {got} != {want}")
        if dist.get_rank() == 0:
            print(f"DTYPE-EVIDENCE {name}:{dtype}: {type(engine.optimizer).__name__}, module "
                  f"{next(engine.module.parameters()).dtype}, loss scaler {got}", flush=True)
    elif meta.get("loss_scaler"):  # recorded by generate_autotp.py since the fp16 fixtures: the saved scaler's state
        sc = getattr(opt, "loss_scaler", None)
        got = {k: v for k, v in vars(sc).items() if k != "dtype"} if sc is not None else None
        want = {k: v for k, v in meta["loss_scaler"].items() if k not in ("class", "dtype")}
        if sc is None or type(sc).__name__ != meta["loss_scaler"]["class"] or got != want:
            problems.append(f"loss scaler {type(sc).__name__} {got} != {meta['loss_scaler']}")
    opt = opt.optimizer if hasattr(opt, "optimizer") else opt
    steps = {float(s["step"]) for s in opt.state.values() if "step" in s}
    # The stage-0 16-bit wrapper steps Adam once at construction (4 after 3 steps): truth.json records the step
    # where it is not the number of steps (the fixtures made since the fp16 ones record it always).
    want_steps = set(meta.get("adam_step") or [float(am.STEPS)])
    if steps != want_steps:
        problems.append(f"Adam step {sorted(steps)} != {sorted(want_steps)}")
    engine.eval()
    vocab = meta["model_config"]["vocab" if megatron else "vocab_size"]
    with torch.no_grad():
        ids = am.eval_ids(vocab)
        logits = (engine(ids) if megatron else engine(input_ids=ids).logits).detach().float().cpu()
    diff = float((logits - truth["logits"]).abs().max())
    atol = logits_slack(float(truth["logits"].abs().max()), meta["dtype"])
    if not same_tp:
        recorded = meta["crosscheck"]["merged_fp32_logits"][f"max_abs_diff_{meta['dtype']}_model"]
        atol += args.logits_atol if args.logits_atol is not None else recorded
    if dtype:  # another precision computes other logits: finite is what is asked of them
        if not torch.isfinite(logits).all():
            problems.append("logits are not finite")
    elif not diff <= atol:
        problems.append(f"logits differ from the source engine's by {diff:.3g} > {atol:.3g}")
    engine.train()
    ids = am.make_batch(am.STEPS, dp_rank, vocab)
    if megatron:  # as generate_autotp.forward_loss
        out = engine(ids)
        loss = torch.nn.functional.cross_entropy(out.float().reshape(-1, out.shape[-1]), ids.reshape(-1))
    else:
        loss = engine(input_ids=ids, labels=ids).loss
    engine.backward(loss)
    engine.step()
    if not torch.isfinite(loss):
        problems.append(f"loss after resume is {float(loss)}")
    if dist.get_rank() == 0:
        print(f"LOGITS {name} ({ckpt_dir}): max |diff| {diff:.6g}", flush=True)
    return problems


report_checks(args.pairs, check_one, args.result)
