"""The precision dimension of a reshard (``--dtype fp32|fp16|bf16``, issue 39 item 5): everything precision-specific
about the target, decided once in phase 2 and applied in phase 3 (``docs/design.md``).

Phase 2 (:mod:`.target`) calls :func:`decide_precision` (the :class:`PrecisionTarget` of the request) and its rows
call :func:`precision_refusal` and :func:`loss_scale_refusal`. Phase 3 reads the decided fields -- the optimizer
files' ``bf16_`` prefix, the 16-bit dtype, the loss scaler, the ``ds_config`` block -- and :func:`retype_tree` (the
mirror of :func:`.retarget.retarget_tree` for parallel sizes) rewrites each written tree for them. Nothing here
changes a file when the precision is kept: a reshard without ``--dtype`` writes what it wrote before, byte for byte.

What DeepSpeed 0.19.8 does, which the target follows:

* **Masters and optimizer state** are fp32 in every precision; they are kept exactly.
* **16-bit copies** (the module's params) are made from the masters by ``.to(dtype)`` (round to nearest even):
  ZeRO-1/2 ``_update_model_bit16_weights`` / the load path copying ``single_partition_of_fp32_groups`` into the
  ``bit16_groups`` (stage_1_and_2.py ``_restore_from_fp32_weights``: ``bit16_partitions[...].data.copy_(fp32)``),
  ZeRO-3 ``_restore_from_fp32_weights`` into ``fp16_partitioned_groups_flat``. A frozen param has no master: its
  one stored copy is cast. At fp32 the module's params equal the masters.
* **Buffers** keep the dtype the live module has (engine.py ``_get_module_cast_dtypes``: buffers are cast only with
  ``data_types.buffer_dtype``); a plain run keeps them fp32, so a precision change writes floating buffers as fp32
  (a 16-bit buffer widens exactly) and drops ``data_types.buffer_dtype`` from the recorded config.
* **File names**: ZeRO optimizer files carry ``bf16_`` whenever bf16 is enabled (engine.py
  ``_get_zero_ckpt_name``: ``bf16_mode = self.bfloat16_enabled()``).
* **Loss scaler** (``CreateLossScaler``): fp16 gets a ``DynamicLossScaler`` started as ``DynamicLossScaler.__init__``
  does (``cur_scale`` = 2**``initial_scale_power`` (16) or ``--loss-scale``, ``cur_iter`` 0, ``last_overflow_iter``
  -1, ``scale_factor`` 2.0, ``scale_window`` 1000, ``min_scale`` 1, ``delayed_shift`` = ``cur_hysteresis`` = 2,
  ``consecutive_hysteresis`` False, ``raise_error_at_min_scale`` True); bf16 and fp32 a static ``LossScaler(1.0)``
  with ``dynamic_loss_scale`` False, as their ZeRO files hold (``BF16_Optimizer`` files keep none).
* **Wrapper** (engine.py ``_do_optimizer_sanity_check``): ZeRO-1 with bf16 params and fp32 gradient accumulation
  builds ``BF16_Optimizer``; bf16 with DeepSpeed's default ``grad_accum_dtype`` (the model's) builds
  ``DeepSpeedZeroOptimizer``. A precision change writes the ZeRO wrapper (``BF16_Optimizer`` needs bf16).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import CorruptCheckpointError
from ..model import Kind, LogicalCheckpoint, Precision, Role

if TYPE_CHECKING:
    from .source import SourceDescription

__all__ = ["DEFAULT_INITIAL_SCALE_POWER", "DTYPE_NAMES", "PrecisionTarget", "decide_precision", "loss_scale_refusal",
           "precision_refusal", "retype_tree"]

#: DeepSpeed 0.19.8's ``fp16.initial_scale_power`` default (precision_config.py)
DEFAULT_INITIAL_SCALE_POWER = 16
#: the module dtype (torch's name) of each precision
DTYPE_NAMES = {Precision.FP32: "float32", Precision.BF16: "bfloat16", Precision.FP16: "float16"}
_CONFIG_KEYS = ("fp16", "bf16", "bfloat16")


@dataclass(frozen=True)
class PrecisionTarget:
    """The target's precision and what it decides: ``source`` the source's; ``loss_scale`` the fp16 scaler's initial
    scale (``--loss-scale``; None: DeepSpeed's default 2**16)."""

    precision: Precision
    source: Precision
    loss_scale: float | None = None

    @property
    def changed(self) -> bool:
        return self.precision is not self.source

    @property
    def bit16_dtype(self) -> str:
        """The module params' dtype (torch's name)."""
        return DTYPE_NAMES[self.precision]

    def bf16_prefix(self, source_prefixed: bool) -> bool:
        """Whether the ZeRO optimizer files are named ``bf16_...``: as the source's when the precision is kept."""
        return self.precision is Precision.BF16 if self.changed else source_prefixed

    @property
    def initial_scale(self) -> float | int:
        return self.loss_scale if self.loss_scale is not None else 2 ** DEFAULT_INITIAL_SCALE_POWER

    def config_block(self) -> str | None:
        """The ``ds_config`` precision block to resume with (None: fp32, neither block). fp16: dynamic scaling
        (``loss_scale`` 0, DeepSpeed's default); the scaler's values come from the files (ZeRO loads the pickled
        scaler in place of the engine's)."""
        if self.precision is Precision.BF16:
            return '"bf16": {"enabled": true}'
        if self.precision is Precision.FP16:
            return '"fp16": {"enabled": true}'
        return None

    def note(self) -> str:
        scaler = (f"a new dynamic loss scaler at {_fmt(self.initial_scale)}" if self.precision is Precision.FP16
                  else "no dynamic loss scaler (static LossScaler(1.0), as DeepSpeed's ZeRO files hold)")
        return (f"precision {self.source.value} -> {self.precision.value}: fp32 masters and optimizer state kept "
                f"exactly; 16-bit copies cast from the masters to {self.bit16_dtype} (frozen params from their "
                f"stored copy); floating buffers fp32; {scaler}")


def _fmt(x: float | int) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def decide_precision(src: SourceDescription, dtype: str | None, loss_scale: float | None) -> PrecisionTarget:
    """The target's precision: ``dtype`` (``fp32``/``fp16``/``bf16``) or the source's."""
    target = src.precision if dtype is None else Precision(dtype)
    return PrecisionTarget(target, src.precision, loss_scale if target is Precision.FP16 else None)


def loss_scale_refusal(dtype: str | None, loss_scale: Any, precision: PrecisionTarget) -> str | None:
    """A usage error for ``--dtype`` / ``--loss-scale`` values (None: they pass)."""
    import math

    if dtype is not None and dtype not in ("fp32", "fp16", "bf16"):
        return f"--dtype must be fp32, fp16 or bf16, got {dtype!r}"
    if loss_scale is None:
        return None
    if not (isinstance(loss_scale, (int, float)) and math.isfinite(loss_scale) and loss_scale > 0):
        return f"--loss-scale {loss_scale}: give a positive finite loss scale (e.g. 1024)"
    if precision.precision is not Precision.FP16 or not precision.changed:
        return ("--loss-scale starts the dynamic loss scaler of an fp16 target written from a bf16 or fp32 run "
                "(--dtype fp16); " + ("a bf16 or fp32 target has none" if precision.precision is not Precision.FP16
                                      else "to reset an fp16 run's scaler use `dsckpt repair CKPT OUT --loss-scale S`"))
    return None


def precision_refusal(src: SourceDescription, precision: PrecisionTarget, stage: int, tp: int, pp_target: bool,
                      experts: bool) -> str | None:
    """Why a precision change cannot be written for this target (None: it can). Refused by name: a target
    without ZeRO (the stage-0 wrappers' state dicts -- FP16_Optimizer, FP16_UnfusedOptimizer, BF16_Optimizer, the
    torch optimizer at fp32 -- differ in kind, and dsckpt does not rebuild one from another yet); pipeline
    parallelism (its layer files hold 16-bit copies dsckpt does not recast yet); an AutoEP ZeRO-1/2 target (its
    expert files hold each rank's slice of fused expert tensors, not recast yet). Written: tensor-parallel targets
    (each model-parallel rank's trees recast from its own view's masters, :func:`~dsckpt.ds_writers.build_jobs`),
    native MoE (each expert file's params, by name, from their masters), AutoEP ZeRO-3 targets (no expert files)."""
    if not precision.changed:
        return None
    what = f"cannot reshard '{src.tag_dir}' from {precision.source.value} to {precision.precision.value}"
    if stage == 0:
        return (f"{what} without ZeRO: a stage-0 save keeps its precision wrapper's own state dict "
                "(FP16_Optimizer / FP16_UnfusedOptimizer / BF16_Optimizer / the torch optimizer at fp32), which dsckpt "
                "does not rebuild for another precision; change the precision at --zero-stage 1, 2 or 3")
    if (src.pipeline or pp_target) and (src.tensor_parallel or tp != 1):
        return (f"{what}: a tensor-parallel pipeline run's layer files (layer_XX-model_YY-...) hold each TP rank's "
                "16-bit slices, which dsckpt does not recast from the masters yet; write --universal and load it "
                "with the precision you want")
    if src.autoep and stage != 3:
        return (f"{what}: AutoEP's expert files (layer_L_expert_X_...) hold each expert-parallel rank's slice of "
                "the fused expert tensors, which dsckpt does not recast from the masters yet; change the precision "
                "at --zero-stage 3, or write --universal and load it with the precision you want")
    return None


# --------------------------------------------------------------------------------------------
# Phase 3: each written tree rewritten for the target's precision


def new_loss_scaler(precision: PrecisionTarget) -> tuple[Any, bool]:
    """``(loss_scaler, dynamic_loss_scale)`` as DeepSpeed's ``CreateLossScaler`` starts them for the target."""
    from ..stand_ins import TorchDtype
    from .common import _stand_in, loss_scaler

    if precision.precision is not Precision.FP16:
        return loss_scaler(1.0), False
    cls = _stand_in("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler")
    obj = cls.__new__(cls)
    obj.__dict__.update(
        cur_scale=precision.initial_scale, dynamic=True, cur_iter=0, last_overflow_iter=-1, scale_factor=2.0,
        scale_window=1000, min_scale=1, delayed_shift=2, cur_hysteresis=2, consecutive_hysteresis=False,
        raise_error_at_min_scale=True, dtype=TorchDtype("float16"))
    return obj, True


def config_for(config: Any, precision: PrecisionTarget) -> Any:
    """The recorded ``ds_config`` with the target's precision block (and no ``data_types.buffer_dtype``)."""
    if not isinstance(config, Mapping):
        return config
    out = {k: v for k, v in config.items() if k not in _CONFIG_KEYS}
    if precision.precision is Precision.BF16:
        out["bf16"] = {"enabled": True}
    elif precision.precision is Precision.FP16:
        out["fp16"] = {"enabled": True}
    dt = out.get("data_types")
    if isinstance(dt, Mapping) and "buffer_dtype" in dt:
        rest = {k: v for k, v in dt.items() if k != "buffer_dtype"}
        if rest:
            out["data_types"] = rest
        else:
            del out["data_types"]
    return out


#: DeepSpeed's expert files (engine.py ``_get_expert_ckpt_name``), native MoE and AutoEP
_EXPERT_FILE = re.compile(r"^layer_\d+_expert_\d+_mp_rank_\d+_model_states\.pt$")
#: PipelineModule's layer files (module.py ``ckpt_layer_path``) without tensor parallelism
_LAYER_FILE = re.compile(r"^layer_\d+-model_states\.pt$")


def _retyped_layer_file(tree: Any, name: str, dtype: str, whole: LogicalCheckpoint, cache: Any) -> Any:
    """Layer file ``name``'s ``tree`` recast: each key's entry is the one whose stored module copy (any replica: a
    tied param's copies) the source keeps at that key of that file; a floating key found in no entry is refused
    rather than guessed."""
    import torch

    from ..writers.torch_stream import dtype_name

    owner: dict[str, Any] = {}
    for entry in whole.entries:
        for p in entry.pieces:
            if p.role is Role.MODULE:
                for f in p.fragments:
                    if f.file is not None and f.file.name == name and len(f.key) == 1:
                        owner.setdefault(f.key[0], entry)
    out: OrderedDict[str, Any] = OrderedDict()
    for key, value in tree.items():
        e: Any = owner.get(key)
        if e is None:
            if isinstance(value, torch.Tensor) or dtype_name(value) in ("float16", "bfloat16", "float32"):
                raise CorruptCheckpointError(f"'{whole.tag_dir}': {name} key '{key}' is no param or buffer dsckpt "
                                             "read; it cannot be recast")
            out[key] = value
            continue
        if e.tied_to is not None:
            e = next(x for x in whole.entries if x.name == e.tied_to)
        out[key] = _retyped(e, value, dtype, whole, cache, {})
    return out if isinstance(tree, OrderedDict) else dict(out)


def retype_tree(tree: Any, precision: PrecisionTarget | None, ckpt: LogicalCheckpoint, cache: Any,
                name: str = "", whole: LogicalCheckpoint | None = None) -> Any:
    """``tree`` (a written file's) rewritten for ``precision``: module params cast from their masters (frozen ones
    from their stored copy; ZeRO-3's 0-element placeholders retyped), floating buffers fp32, ZeRO-2/3 frozen
    fragments cast, the optimizer's loss scaler started anew, the recorded ``ds_config``'s precision block. The tree
    itself when the precision is kept. ``name``: the file's; an expert file (``layer_L_expert_E_...``) holds its
    experts' params by name, each cast from its master; a pipeline layer file (``layer_XX-model_states.pt``, copied
    from the source) its layer's, found through the source's fragments in ``whole`` (the whole source; ``ckpt`` is
    the model-parallel rank's view)."""
    if precision is None or not precision.changed or not isinstance(tree, Mapping):
        return tree
    dtype = precision.bit16_dtype
    by_name = {e.name: e for e in ckpt.entries}
    if _EXPERT_FILE.match(name):  # a MoE expert file: {param name: its 16-bit (or fp32) module copy}
        done: dict[str, Any] = {}
        for key, value in tree.items():
            done[key] = _retyped(by_name.get(key), value, dtype, ckpt, cache, done) if isinstance(key, str) else value
        return type(tree)(done.items()) if isinstance(tree, OrderedDict) else done
    if _LAYER_FILE.match(name):  # a pipeline layer file: {local key: the layer's param or buffer}, copied
        return _retyped_layer_file(tree, name, dtype, whole if whole is not None else ckpt, cache)
    out = dict(tree)
    if isinstance(out.get("module"), Mapping):
        module: OrderedDict[str, Any] = OrderedDict()
        for key, value in out["module"].items():
            module[key] = _retyped(by_name.get(key), value, dtype, ckpt, cache, module)
        out["module"] = module
        frozen = out.get("frozen_param_fragments")
        if isinstance(frozen, Mapping):
            out["frozen_param_fragments"] = OrderedDict(
                (k, module[k] if (k in module and _numel(v) == _numel(module[k])) else _cast(_load(v, cache), dtype))
                for k, v in frozen.items())
    osd = out.get("optimizer_state_dict")
    if isinstance(osd, Mapping) and "loss_scaler" in osd:
        scaler, dynamic = new_loss_scaler(precision)
        out["optimizer_state_dict"] = {**osd, "loss_scaler": scaler, "dynamic_loss_scale": dynamic}
    if "ds_config" in out:
        out["ds_config"] = config_for(out["ds_config"], precision)
    return out


def _retyped(e: Any, value: Any, dtype: str, ckpt: LogicalCheckpoint, cache: Any,
             done: Mapping[str, Any]) -> Any:
    from ..writers.torch_stream import StreamedTensor, dtype_name

    if value is None:
        return None
    if e is None or e.kind is Kind.BUFFER:  # buffers: fp32 where floating (DeepSpeed keeps them as the live module)
        if dtype_name(value) in ("float16", "bfloat16"):
            return _cast(_load(value, cache), "float32")
        return value
    if e.tied_to is not None and e.tied_to in done:
        return done[e.tied_to]
    if _numel(value) == 0 and e.numel != 0:  # a ZeRO-3 placeholder
        return StreamedTensor(dtype, (0,), ())
    if e.trainable:
        master = _master(e)
        if master is None:
            raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{e.name}' has no fp32 master to cast")
        from ..assemble import read_piece

        return _cast(read_piece(master, e.shape, cache, name=e.name), dtype)
    return _cast(_load(value, cache), dtype)


def _master(e: Any) -> Any:
    """The fp32 master piece of trainable ``e``: a stage-0 fp32 save keeps none, its module weights are the
    masters."""
    master = e.piece(Role.MASTER)
    if master is None:
        module = e.piece(Role.MODULE)
        master = module if module is not None and module.dtype == "float32" else None
    return master


def _numel(value: Any) -> int:
    n = getattr(value, "numel", None)
    if callable(n):
        return int(n())
    return int(n) if n is not None else -1


def _cast(t: Any, dtype: str) -> Any:
    import torch

    return t.to(getattr(torch, dtype)).contiguous()


def _load(value: Any, cache: Any) -> Any:
    """A torch tensor of ``value``: a torch tensor, a source :class:`~dsckpt.tensor_ref.TensorRef`, or a
    :class:`~dsckpt.writers.torch_stream.StreamedTensor` (its extents read; zeros where they say so)."""
    import torch

    from ..writers.torch_stream import StreamedTensor

    if isinstance(value, torch.Tensor):
        return value
    if isinstance(value, StreamedTensor):
        buf = bytearray()
        for ext in value.extents:
            if ext.path is None:
                buf += bytes(ext.nbytes)
            else:
                with open(ext.path, "rb") as f:
                    f.seek(ext.file_offset)
                    chunk = f.read(ext.nbytes)
                if len(chunk) != ext.nbytes:
                    raise CorruptCheckpointError(f"{ext.path}: truncated at byte {ext.file_offset}")
                buf += chunk
        flat = torch.frombuffer(buf, dtype=getattr(torch, value.dtype)) if buf else torch.empty(
            0, dtype=getattr(torch, value.dtype))
        return flat.reshape(value.shape).clone()
    return value.load()


# --------------------------------------------------------------------------------------------
# Verification (readback.py): a recast module copy is compared with the cast it must be


def module_copy_problem(e: Any, new_piece: Any, src_cache: Any, new_cache: Any,
                        precision: PrecisionTarget) -> str | None:
    """Why the output's module copy ``new_piece`` of source entry ``e`` is not what :func:`retype_tree` writes
    (every value, bit for bit); None when it is."""
    import torch

    from ..assemble import read_piece

    if e.kind is Kind.BUFFER:
        src = e.piece(Role.MODULE)
        if src is None:
            return None
        want = read_piece(src, e.shape, src_cache, name=e.name)
        if want.dtype in (torch.float16, torch.bfloat16):
            want = want.float()
    elif e.trainable:
        master = _master(e)
        if master is None:
            return None
        want = _cast(read_piece(master, e.shape, src_cache, name=e.name), precision.bit16_dtype)
    else:
        src = e.piece(Role.MODULE)
        if src is None:
            return None
        want = _cast(read_piece(src, e.shape, src_cache, name=e.name), precision.bit16_dtype)
    got = read_piece(new_piece, e.shape, new_cache, name=e.name)
    if got.dtype != want.dtype:
        return f"'{e.name}' (module) is {got.dtype}, expected {want.dtype}"
    if got.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() != want.contiguous().reshape(-1).view(
            torch.uint8).numpy().tobytes():
        return f"'{e.name}' (module) is not its {'master' if e.trainable else 'stored copy'} cast to {want.dtype}"
    return None


def padding_copy_problem(e: Any, new_piece: Any, src_cache: Any, new_cache: Any,
                         precision: PrecisionTarget) -> str | None:
    """Why the output's module copy of ``e``'s vocabulary padding rows (``new_piece``) is not the source's master
    padding rows cast (a trainable param: Megatron's vocab-parallel loss trains them) or its stored padding cast;
    None when it is, every value bit for bit."""
    import torch

    from ..assemble import read_piece

    src = e.padding_piece(Role.MASTER) if e.trainable else None
    if src is None:
        src = e.padding_piece(Role.MODULE)
        if src is None:
            return None
    shape = (src.numel,)
    want = _cast(read_piece(src, shape, src_cache, name=e.name), precision.bit16_dtype)
    got = read_piece(new_piece, (new_piece.numel,), new_cache, name=e.name)
    if got.dtype != want.dtype or got.numel() != want.numel():
        return f"'{e.name}' (module padding rows) is {got.dtype}[{got.numel()}], expected {want.dtype}[{want.numel()}]"
    if got.view(torch.uint8).numpy().tobytes() != want.view(torch.uint8).numpy().tobytes():
        return f"'{e.name}' (module padding rows) are not the master's padding rows cast to {want.dtype}"
    return None
