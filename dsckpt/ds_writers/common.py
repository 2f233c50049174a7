"""Tree pieces shared by the DeepSpeed layout writers: streamed flat tensors, DeepSpeed stand-in
objects, and the optimizer scalars a writer carries from a source of another layout.

Trees are what :func:`dsckpt.writers.torch_stream.write_torch_tree` writes: dicts and lists whose
tensor leaves are source :class:`~dsckpt.tensor_ref.TensorRef` s (copied whole), streamed tensors
(byte ranges of source files and zeros) or, rarely, ``torch.Tensor`` s.
"""

from __future__ import annotations

import copy
import math
import re
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import OSD
from .plan import FlatSpec, LayoutPlan

__all__ = [
    "OSD",
    "OptimizerScalars",
    "fmt_key",
    "fragment_address",
    "dynamic_loss_scaler_from_stage0",
    "loss_scaler",
    "optimizer_scalars",
    "own_copy",
    "retarget_stage_keys",
    "retarget_tp_keys",
    "shapes_tree",
    "stage0_scalars",
    "stage0_scale_fields",
    "streamed",
    "target_ds_config",
    "universal_scalars",
    "zero_keys_from_stage0",
    "zero_stage_enum",
]



def fmt_key(key: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in key[1:]) if key and key[0] == OSD else "".join(f"[{k!r}]" for k in key)


def streamed(spec: FlatSpec, cache: Any, attrs: dict[str, Any] | None = None, *,
             shape: tuple[int, ...] | None = None) -> Any:
    """The target tensor of ``spec`` as source byte ranges with zero runs between them
    (``shape``: a view of its elements other than 1-D)."""
    from ..writers.torch_stream import Extent, StreamedTensor, dtype_name, element_nbytes

    item = element_nbytes(spec.dtype)
    extents: list[Extent] = []
    pos = 0  # elements of the target covered so far

    def add(ext: Extent) -> None:
        last = extents[-1] if extents else None
        if last is not None and last.path == ext.path and last.record is ext.record and (
                ext.path is None or last.file_offset + last.nbytes == ext.file_offset):
            extents[-1] = Extent(last.path, last.file_offset, last.nbytes + ext.nbytes, last.record,
                                 last.record_offset)
        else:
            extents.append(ext)

    for c in sorted(spec.copies, key=lambda c: c.dst_offset):
        ref = cache.tensor(c.file, c.key)
        if dtype_name(ref) != spec.dtype:
            raise CorruptCheckpointError(f"{c.file}: {fmt_key(c.key)} is {dtype_name(ref)}, expected {spec.dtype}")
        if not ref.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{c.file}: {fmt_key(c.key)} is stored non-contiguously; flat ZeRO partitions never are")
        first = ref.storage_offset + c.src_offset
        if c.src_offset < 0 or c.src_offset + c.numel > ref.numel or first + c.numel > ref.storage.numel:
            raise CorruptCheckpointError(
                f"{c.file}: {fmt_key(c.key)} has {ref.numel} elements, but the checkpoint's metadata places "
                f"elements [{c.src_offset}, {c.src_offset + c.numel}) in it; the metadata does not match")
        assert c.dst_offset >= pos and c.dst_offset + c.numel <= spec.numel, "overlapping copy ranges"
        if c.dst_offset > pos:
            add(Extent(None, 0, (c.dst_offset - pos) * item))
        add(Extent(Path(ref.storage.path), ref.storage.file_offset + first * item, c.numel * item,
                   ref.storage.check, first * item))
        pos = c.dst_offset + c.numel
    if pos < spec.numel:
        add(Extent(None, 0, (spec.numel - pos) * item))
    if shape is not None:
        assert math.prod(shape) == spec.numel, "shape does not match the flat tensor"
    return StreamedTensor(spec.dtype, shape if shape is not None else (spec.numel,), tuple(extents),
                          dict(attrs or {}))


def own_copy(value: Any) -> Any:
    """A storage of its own for a small per-group state value such as Adam's ``step``: torch's
    ``Optimizer.load_state_dict`` keeps ``step`` tensors as loaded, so one pickled storage shared by
    several groups would be incremented once per group and step."""
    from ..tensor_ref import TensorRef
    from ..writers.torch_stream import Extent, StreamedTensor, dtype_name, element_nbytes

    if not isinstance(value, TensorRef):
        return value
    if not value.is_contiguous():
        return value.load().clone()
    item = element_nbytes(dtype_name(value))
    ext = Extent(Path(value.storage.path), value.storage.file_offset + value.storage_offset * item,
                 value.numel * item, value.storage.check, value.storage_offset * item)
    return StreamedTensor(dtype_name(value), tuple(value.shape), (ext,), dict(value.attrs))


def _stand_in(module: str, name: str) -> Any:
    from ..stand_ins import stand_in_class

    cls = stand_in_class(module, name)
    assert cls is not None
    return cls


def fragment_address(numel: int, start: int) -> Any:
    cls = _stand_in("deepspeed.utils.tensor_fragment", "fragment_address")
    obj = cls.__new__(cls)
    obj.__dict__.update(numel=numel, start=start)
    return obj


def zero_stage_enum(stage: int) -> Any:
    """DeepSpeed's pickled ``ZeroStageEnum`` member (runtime/zero/config.py:81-87)."""
    return _stand_in("deepspeed.runtime.zero.config", "ZeroStageEnum")(stage)


def loss_scaler(cur_scale: Any = 1.0) -> Any:
    """The static ``LossScaler`` DeepSpeed 0.19.8 pickles in ZeRO optimizer files: ``LossScaler(1.0)`` in fp32 and
    bf16 ones (``BF16_Optimizer`` files have none), ``LossScaler(fp16.loss_scale)`` with a static fp16 scale."""
    cls = _stand_in("deepspeed.runtime.fp16.loss_scaler", "LossScaler")
    obj = cls.__new__(cls)
    obj.__dict__.update(cur_scale=cur_scale, dynamic=False)
    return obj


# The stage-0 FP16_Optimizer / FP16_UnfusedOptimizer loss-scale fields (fused_optimizer.py and unfused_optimizer.py
# ``state_dict``, DeepSpeed 0.19.8): what they keep of the dynamic scaler. ZeRO pickles the whole DynamicLossScaler.
STAGE0_SCALE_KEYS = ("dynamic_loss_scale", "cur_scale", "cur_iter")
STAGE0_DYNAMIC_KEYS = ("last_overflow_iter", "scale_factor", "scale_window")


def dynamic_loss_scaler_from_stage0(opt: Mapping[str, Any], ds_config: Any) -> Any:
    """ZeRO's pickled ``DynamicLossScaler`` (loss_scaler.py:219-239) for the dynamic scale a stage-0 fp16 save keeps
    in its optimizer's fields: ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``,
    ``scale_window`` as saved. The rest is configuration, not state, and comes from the recorded ds_config's ``fp16``
    section with DeepSpeed's defaults (precision_config.py ``dynamic_loss_scale_args``): ``min_scale``
    (``min_loss_scale``, 1), ``delayed_shift`` (``hysteresis``, 2), ``consecutive_hysteresis`` (False). The stage-0
    optimizers have no hysteresis, so ``cur_hysteresis`` is the full ``delayed_shift`` a ZeRO run starts with."""
    from ..stand_ins import TorchDtype

    fp16 = ds_config.get("fp16") if isinstance(ds_config, Mapping) else None
    fp16 = fp16 if isinstance(fp16, Mapping) else {}
    hysteresis = fp16.get("hysteresis", 2)
    cls = _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
    obj = cls.__new__(cls)
    obj.__dict__.update(
        cur_scale=opt["cur_scale"], cur_iter=opt["cur_iter"], last_overflow_iter=opt["last_overflow_iter"],
        scale_factor=opt["scale_factor"], scale_window=opt["scale_window"],
        min_scale=fp16.get("min_loss_scale", 1), delayed_shift=hysteresis, cur_hysteresis=hysteresis,
        consecutive_hysteresis=fp16.get("consecutive_hysteresis", False), raise_error_at_min_scale=True,
        dynamic=True, dtype=TorchDtype("float16"))
    return obj


def stage0_scale_fields(scaler: Any, *, fp16: bool, cur_iter: int) -> dict[str, Any]:
    """The loss-scale fields of a stage-0 ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer`` state dict for the ZeRO
    ``scaler`` (the source's pickled ``LossScaler`` / ``DynamicLossScaler``): what those optimizers load back
    (``load_state_dict``). A static scaler keeps no iteration count; ``cur_iter`` stands in for it (the stage-0
    optimizers count every step, as ``global_steps`` does). ``cur_hysteresis`` has no stage-0 counterpart (those
    optimizers lower the scale at the first overflow)."""
    state = getattr(scaler, "__dict__", {})
    if not fp16:  # bf16: no scaling (LossScaleConfig.use_grad_scaling is False); what 0.19.8 saves for it
        return {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": cur_iter}
    if state.get("dynamic"):
        return {"dynamic_loss_scale": True, **{k: state[k] for k in ("cur_scale", "cur_iter", *STAGE0_DYNAMIC_KEYS)}}
    return {"dynamic_loss_scale": False, "cur_scale": state.get("cur_scale", 1.0), "cur_iter": cur_iter}


def shapes_tree(plan: LayoutPlan, like: Any = None) -> list[OrderedDict[str, Any]]:
    """``param_shapes`` as DeepSpeed writes them: ``torch.Size`` values, except where the source ``like``
    holds plain tuples (0.19.8 ``_save_moe_checkpoint`` passes the state through ``clone_tensors_for_torch_save``,
    which rebuilds every tuple, ``torch.Size`` included, as a tuple)."""
    from ..writers.torch_stream import Size

    as_tuple = isinstance(like, list) and any(
        isinstance(g, Mapping) and any(type(v) is tuple for v in g.values()) for g in like)
    return [OrderedDict((n, tuple(s) if as_tuple else Size(s)) for n, s in group) for group in plan.param_shapes]


@dataclass(frozen=True)
class OptimizerScalars:
    """What a ZeRO optimizer file holds besides its flat partitions, read from a source file of any
    layout: carried into files of another layout.

    ``param_groups``: the inner optimizer's hyperparameters per param group, ``params`` left out;
    ``group_states``: per param group, its optimizer state as stored (the first sub-group's at stage 3; ``{}``
    before any step): its ``step`` and other scalars are carried as saved, its per-element tensors are replaced
    by the writer; ``step``: the first group's step; ``clip_grad``: ``None`` when the source does not store it
    (stage 3), so that the new engine keeps its configured value.
    """

    loss_scaler: Any
    dynamic_loss_scale: Any
    overflow: Any
    clip_grad: Any
    param_groups: tuple[Mapping[str, Any], ...]
    step: Any
    ds_version: Any
    top: Mapping[str, Any]  # the file's other top-level keys (ds_config, ds_version ...)
    group_states: tuple[Mapping[str, Any], ...] = ()


def optimizer_scalars(src0: Mapping[str, Any], source_stage: int) -> OptimizerScalars:
    """The scalars of source rank 0's optimizer file ``src0`` (ZeRO-1/2, BF16_Optimizer or ZeRO-3)."""
    osd = src0[OSD]
    inner = osd[OSD] if source_stage == 3 else osd["base_optimizer_state"]
    groups = tuple({k: v for k, v in pg.items() if k != "params"} for pg in inner["param_groups"])
    states = group_states(inner)
    steps = [s["step"] for s in states if "step" in s]
    return OptimizerScalars(
        loss_scaler=osd["loss_scaler"] if "loss_scaler" in osd else loss_scaler(),
        dynamic_loss_scale=osd.get("dynamic_loss_scale", False),
        overflow=osd.get("overflow", False),
        clip_grad=osd.get("clip_grad"),
        param_groups=groups,
        step=steps[0] if steps else None,
        ds_version=osd.get("ds_version", src0.get("ds_version")),
        top={k: v for k, v in src0.items() if k != OSD},
        group_states=states,
    )


def group_states(inner: Mapping[str, Any]) -> tuple[Mapping[str, Any], ...]:
    """Per param group of a ZeRO optimizer's inner state dict, the state of its first flat param (ZeRO-1/2: its one
    flat partition; ZeRO-3: its first sub-group); ``{}`` where it has none."""
    state = inner.get("state") or {}
    out = []
    for pg in inner.get("param_groups") or []:
        params = pg.get("params") if isinstance(pg, Mapping) else None
        first = params[0] if isinstance(params, list) and params else None
        st = state.get(first) if first is not None else None
        out.append(st if isinstance(st, Mapping) else {})
    return tuple(out)


def group_state_tree(group_state: Mapping[str, Any], specs: Mapping[str, FlatSpec], cache: Any,
                     stream: Callable[[FlatSpec], Any] | None = None) -> dict[str, Any]:
    """A flat group's optimizer state in the target: its per-element tensors streamed from ``specs`` (through
    ``stream`` if given: a ZeRO-3 sub-group swapped to NVMe saves empty tensors), every other value (``step``,
    scalars) as the source saved it; the source's key order."""
    put = stream if stream is not None else (lambda spec: streamed(spec, cache))
    out = {k: put(specs[k]) if k in specs else own_copy(v) for k, v in group_state.items()}
    out.update({k: put(spec) for k, spec in specs.items() if k not in out})
    return out


def stage0_scalars(model_states: Mapping[str, Any]) -> OptimizerScalars:
    """The scalars of a stage-0 save (``mp_rank_00_model_states.pt``'s ``optimizer``: a torch optimizer's state
    dict, or ``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``'s around one, fp16/fused_optimizer.py and
    unfused_optimizer.py ``state_dict``). fp32 and bf16 ZeRO files hold a static ``LossScaler(1.0)``; fp16 ones the
    static scale or the ``DynamicLossScaler`` built from the stage-0 fields
    (:func:`dynamic_loss_scaler_from_stage0`)."""
    opt = model_states.get("optimizer")
    if not isinstance(opt, Mapping):
        raise CorruptCheckpointError("the stage-0 model states hold no optimizer state")
    inner: Mapping[str, Any] = opt[OSD] if isinstance(opt.get(OSD), Mapping) else opt
    groups = tuple({k: v for k, v in pg.items() if k != "params"} for pg in inner.get("param_groups") or [])
    steps = [st["step"] for st in (inner.get("state") or {}).values() if isinstance(st, Mapping) and "step" in st]
    dynamic = inner is not opt and bool(opt.get("dynamic_loss_scale"))
    if dynamic:
        missing = [k for k in STAGE0_SCALE_KEYS + STAGE0_DYNAMIC_KEYS if k not in opt]
        if missing:
            raise CorruptCheckpointError(f"the stage-0 optimizer has a dynamic loss scale but no {', '.join(missing)}")
        scaler = dynamic_loss_scaler_from_stage0(opt, model_states.get("ds_config"))
    else:  # a static scale (fp16 "loss_scale" > 0), or none (fp32, bf16): LossScaler(cur_scale)
        scaler = loss_scaler(opt.get("cur_scale", 1.0) if inner is not opt else 1.0)
    return OptimizerScalars(
        loss_scaler=scaler, dynamic_loss_scale=dynamic, overflow=False, clip_grad=opt.get("clip_grad"),
        param_groups=groups, step=steps[0] if steps else None, ds_version=model_states.get("ds_version"),
        top={k: model_states[k] for k in ("ds_config", "ds_version") if k in model_states},
        group_states=tuple(_scalar_state(st) for st in group_states(inner)),
    )


def _scalar_state(state: Mapping[str, Any]) -> dict[str, Any]:
    """A param's (or flat group's) optimizer state without its per-element tensors: what a group of another layout
    carries as saved (``step``, NAdam's ``mu_product`` ...); the writer adds the per-element tensors."""
    from ..tensor_ref import TensorRef

    return {k: v for k, v in state.items() if not (isinstance(v, TensorRef) and v.numel > 1)}


def universal_scalars(ckpt: Any, cache: Any) -> OptimizerScalars:
    """The scalars of a universal folder: ``zero/optimizer_state.pt`` (source rank 0's ZeRO optimizer dict
    without its partitions, plus ``param_groups``; ds_to_universal.py), the step from a ``step.pt`` (ZeRO-1/2
    sources) or the inner optimizer state (ZeRO-3 sources)."""
    from ..layout import UNIVERSAL_DIR, UNIVERSAL_OPTIMIZER_STATE
    from ..tensor_ref import TensorRef

    opt = cache.tree(ckpt.tag_dir / UNIVERSAL_DIR / UNIVERSAL_OPTIMIZER_STATE)
    inner = opt.get(OSD) if isinstance(opt.get(OSD), Mapping) else {}
    steps = [st["step"] for st in (inner.get("state") or {}).values() if isinstance(st, Mapping) and "step" in st]
    if not steps:
        steps = [t for p in sorted(ckpt.files) if p.name == "step.pt"
                 for t in (cache.tree(p),) if isinstance(t, TensorRef)][:1]
    groups = tuple({k: v for k, v in pg.items() if k != "params"} for pg in opt.get("param_groups") or [])
    ms_top = {k: opt[k] for k in ("ds_version",) if k in opt}
    return OptimizerScalars(
        loss_scaler=opt["loss_scaler"] if "loss_scaler" in opt else loss_scaler(),
        dynamic_loss_scale=opt.get("dynamic_loss_scale", False), overflow=opt.get("overflow", False),
        clip_grad=opt.get("clip_grad"), param_groups=groups, step=steps[0] if steps else None,
        group_states=tuple({"step": steps[0]} for _ in groups) if steps else (),
        ds_version=opt.get("ds_version", ckpt.ds_version),
        top={"ds_config": ckpt.ds_config, "ds_version": ckpt.ds_version, **ms_top},
    )


def zero_keys_from_stage0(tree: dict[str, Any], ckpt: Any, rank: int = 0) -> None:
    """A stage-0 model-states tree given the keys a ZeRO one has: no ``optimizer`` (it goes to the optimizer
    files), and ``shared_params`` ({alias: source}) on rank 0, as DeepSpeed computes it (engine.py:5490-5528)."""
    tree["optimizer"] = None
    tree["shared_params"] = {e.name: e.tied_to for e in ckpt.entries if e.tied_to is not None} if rank == 0 else {}


def target_ds_config(config: Any, zero_stage: int, sub_group_size: int | None) -> Any:
    """The recorded ``ds_config`` with the target's ZeRO stage (DeepSpeed does not read it back; it
    tells the next reader what the files are)."""
    if not isinstance(config, Mapping):
        return config
    out = dict(config)
    z = dict(out.get("zero_optimization") or {})
    z["stage"] = zero_stage
    if zero_stage == 3 and sub_group_size is not None and "sub_group_size" in z:
        z["sub_group_size"] = sub_group_size
    out["zero_optimization"] = z
    return out


def retarget_tp_keys(tree: Any, plan: LayoutPlan, layouts: tuple[Any, Any] | None = None) -> Any:
    """A file's top-level keys that record the tensor-parallel size, rewritten for ``plan.tp_size``:
    ``mp_world_size``, ``checkpoint_parallel_dimensions.tp_degree`` (engine.py:420-428), ``ds_config``'s
    ``tensor_parallel`` section, and ``universal_checkpoint_info``. DeepSpeed 0.19.8 attaches an AutoTP record only
    when AutoTP partitions the model (``finalize_autotp(attach_uc_metadata=True)``; with ``autotp_size`` <= 1
    ``_configure_tensor_parallel`` returns before, engine.py), so an AutoTP TP-1 file has none: it is dropped.
    Megatron-DeepSpeed keeps its record in ``client_state`` at every TP size, TP 1 included (``megatron/
    checkpointing.py``), so a Megatron-style record is kept at TP 1 too, where it says which vocabulary rows are
    padding (:func:`dsckpt.readers.tensor_parallel.with_tp1_record`). Elsewhere it is rewritten for the target's cut
    (``layouts``: the source's and the target's :class:`~dsckpt.parallel_layout.TpLayout`;
    :func:`dsckpt.tensor_parallel.megatron_record_at`, :func:`dsckpt.autotp_widths.record_at`)."""
    if not isinstance(tree, Mapping):
        return tree
    out = dict(tree)
    tp = plan.tp_size
    if "mp_world_size" in out:
        out["mp_world_size"] = tp
    dims = out.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping) and "tp_degree" in dims:
        out["checkpoint_parallel_dimensions"] = {**dims, "tp_degree": tp}
    cfg = out.get("ds_config")
    if isinstance(cfg, Mapping) and isinstance(cfg.get("tensor_parallel"), Mapping):
        cfg = dict(cfg)
        if tp == 1:
            del cfg["tensor_parallel"]
        else:
            cfg["tensor_parallel"] = {**cfg["tensor_parallel"], "autotp_size": tp}
        out["ds_config"] = cfg
    megatron = layouts is not None and layouts[1] is not None and layouts[1].source == "megatron"
    if tp == 1 and not megatron:
        out.pop("universal_checkpoint_info", None)
    elif isinstance(out.get("universal_checkpoint_info"), Mapping):
        from ..autotp_widths import record_at
        from ..tensor_parallel import megatron_record_at

        assert layouts is not None, "a TP size change plans both layouts"
        out["universal_checkpoint_info"] = (megatron_record_at(out["universal_checkpoint_info"], layouts[1])
                                            if megatron else record_at(out["universal_checkpoint_info"], *layouts))
    if megatron:
        assert layouts is not None
        _megatron_client_keys(out, layouts[1])
    return out


def _megatron_client_keys(out: dict[str, Any], target: Any) -> None:
    """Megatron-DeepSpeed's client state at ``target``'s TP size: ``checkpoint_info.padded_vocab_size`` (read by
    DeepSpeed's ``DeepSpeedCheckpoint``) and the saved ``args``' ``tensor_model_parallel_size`` /
    ``padded_vocab_size`` (Megatron's ``check_checkpoint_args`` compares them with the run's), where present.
    ``args`` is a dict or an ``argparse.Namespace`` (its stand-in keeps the attributes)."""
    from ..stand_ins import DeepSpeedObject

    rows = target.vocab_rows
    padded = next(iter(rows)) if len(rows) == 1 else None
    info = out.get("checkpoint_info")
    if isinstance(info, Mapping) and padded is not None and "padded_vocab_size" in info:
        out["checkpoint_info"] = {**info, "padded_vocab_size": padded}
    args = out.get("args")
    fields = {"tensor_model_parallel_size": target.tp_size, **({"padded_vocab_size": padded} if padded else {})}
    if isinstance(args, Mapping):
        out["args"] = {**args, **{k: v for k, v in fields.items() if k in args}}
    elif isinstance(args, DeepSpeedObject):
        new = copy.copy(args)
        new.__dict__.update({k: v for k, v in fields.items() if k in args.__dict__})
        out["args"] = new


def retarget_stage_keys(name: str, tree: Any, plan: LayoutPlan, stages: Any) -> Any:
    """A pipeline stage's ``mp_rank_XX_model_states.pt`` with the keys that record the stage count rewritten for
    ``stages`` (a :class:`dsckpt.parallel_layout.StagePlan`): ``mp_world_size`` (stages x TP ranks, the
    model-parallel world of ``PipeModelDataParallelTopology``), ``checkpoint_parallel_dimensions.pp_degree`` and the
    stage's ``buffer_names``. Other files (optimizer states, layer files) record no stage count."""
    if not isinstance(tree, Mapping) or not re.fullmatch(r"mp_rank_\d+_model_states\.pt", name):
        return tree
    out = dict(tree)
    out["mp_world_size"] = stages.pp_size * plan.tp_size
    dims = out.get("checkpoint_parallel_dimensions")
    if isinstance(dims, Mapping):
        out["checkpoint_parallel_dimensions"] = {**dims, "pp_degree": stages.pp_size}
    if "buffer_names" in out:
        out["buffer_names"] = list(stages.buffers[plan.mp_rank // plan.tp_size])
    return out
