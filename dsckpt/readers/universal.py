"""DeepSpeed universal checkpoint folders (``ds_to_universal``, loaded with ``"checkpoint":
{"load_universal": true}``): one folder per parameter, whole tensors, no partitions.

Layout written by DeepSpeed 0.19.8 ``checkpoint/ds_to_universal.py`` (the tag folder is its
``--output_folder``; ``latest_universal`` in the parent names it):

* ``zero/<param>/{fp32,exp_avg,exp_avg_sq}.pt`` for every param in ``param_shapes``. From a ZeRO-1/2
  or ``BF16_Optimizer`` source: ``{"cat_dim": 0, "param": <fp32 tensor of the param's shape>}``
  (``merge_tp_slices``) and ``step.pt``, the group's step as saved: a bare tensor (torch's Adam), or a Python int
  (FusedLamb, DeepSpeedCPULion, FusedAdam). From a ZeRO-3 source:
  a bare flat fp32 tensor (``merge_zero3_slices``) and no ``step.pt`` (the step is in
  ``optimizer_state.pt``).
* ZeRO-1/2 sources also get ``zero/<name>/fp32.pt = {"param": module[name].float()}`` for every other
  module tensor (buffers, frozen params, tied aliases): the upcast 16-bit copy, integer buffers as
  float (ds_to_universal.py:1201-1215). DeepSpeed's loader never reads them.
* ``zero/optimizer_state.pt``: source rank 0's ZeRO optimizer dict without its partitions (ZeRO-1/2)
  or whole (ZeRO-3, rank 0's partitions included), plus ``param_groups``.
* the source's model-states files, copied: ``mp_rank_00_model_states.pt`` (ZeRO-1/2) or every rank's
  ``zero_pp_rank_{d}_mp_rank_00_model_states.pt`` (ZeRO-3). They hold the buffers, frozen params and
  tied-param names, which DeepSpeed's universal loader does not restore (it only visits the
  optimizer's params), so dsckpt reads those from here.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError, first_of
from ..layout import OSD, UNIVERSAL_DIR, UNIVERSAL_OPTIMIZER_STATE, classify_files, expect_dp_ranks
from ..model import Fragment, Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from ..stand_ins import DeepSpeedEnum
from ..tensor_ref import TensorRef
from .autoep import entry_order
from .common import (
    FileCache,
    alias_entry,
    int_or_none,
    is_floating,
    metadata_from_model_states,
    module_piece,
    order_like_module,
    precision_of,
    step_of,
)
from .zero3 import zero3_module_side_entries
from .zero12 import module_side_entries

__all__ = ["STATE_FILES", "UNIVERSAL_KEYS", "read_universal"]

# (role, optimizer state key, file name) of the per-param files ds_to_universal writes; another optimizer's
# per-element states are further <key>.pt files (DeepSpeed's loader reads every one in the folder)
STATE_FILES = ((Role.MASTER, None, "fp32.pt"), (Role.OPTIM_STATE, "exp_avg", "exp_avg.pt"),
               (Role.OPTIM_STATE, "exp_avg_sq", "exp_avg_sq.pt"))
STEP_FILE = "step.pt"
# Keys of a per-param state dict this reader understands. Others (is_expert_param ...) describe expert slicing
# (universal_checkpoint.py). The tensor-parallel ones say how the loader re-cuts an already merged tensor; the
# cut itself is read from the record (dsckpt.tensor_parallel), so they are accepted only with a record (TP > 1, or a
# Megatron-style one at TP 1).
UNIVERSAL_KEYS = frozenset({"param", "cat_dim"})
UNIVERSAL_TP_KEYS = frozenset({"vocab_tensor", "param_n_sub_params", "sub_param_shape"})
UNIVERSAL_EP_KEYS = frozenset({"is_expert_param", "ep_num_experts"})  # AutoEP's stacked expert params


def _param_dir(tag_dir: Path, name: str) -> Path:
    if not name or name in (".", "..") or "/" in name or "\\" in name or "\x00" in name:
        raise CorruptCheckpointError(f"'{tag_dir}': param name {name!r} cannot be a folder of '{UNIVERSAL_DIR}/'; "
                                     "the model-states file is damaged")
    return tag_dir / UNIVERSAL_DIR / name


def _state_piece(path: Path, cache: FileCache, tp: bool, name: str, shape: tuple[int, ...], role: Role,
                 state_key: str | None, num_experts: int | None = None) -> Piece:
    """Param ``name``'s fp32 ``role`` / ``state_key`` piece in the per-param state file ``path``, whose tensor must be
    float32 of ``shape``'s element count."""
    numel = math.prod(shape)
    key, ref = _state_key(path, cache, tp, num_experts)
    if ref.dtype_name != "float32" or ref.numel != numel:
        raise CorruptCheckpointError(
            f"{path}: holds {ref.dtype_name}[{ref.numel}], param '{name}' of shape {list(shape)} needs "
            f"float32[{numel}]; the file is damaged or belongs to another model")
    return Piece(role, "float32", (Fragment(path, key, 0, numel, 0),), state_key=state_key)


def _state_key(path: Path, cache: FileCache, tp: bool, num_experts: int | None = None
               ) -> tuple[tuple[Any, ...], TensorRef]:
    """Where the tensor of one per-param state file is: the file itself (ZeRO-3 source) or ``["param"]``.
    ``num_experts``: an AutoEP expert param's expert count, which its file must state (``ep_num_experts``)."""
    tree = cache.tree(path)
    if isinstance(tree, TensorRef):
        return (), tree
    known = UNIVERSAL_KEYS | UNIVERSAL_TP_KEYS if tp else UNIVERSAL_KEYS
    if num_experts is not None:
        if tree.get("is_expert_param") is not True or tree.get("ep_num_experts") != num_experts:
            raise CorruptCheckpointError(
                f"{path}: the AutoEP record names it a stacked param of {num_experts} experts, the file says "
                f"is_expert_param={tree.get('is_expert_param')!r}, ep_num_experts={tree.get('ep_num_experts')!r}")
        known = known | UNIVERSAL_EP_KEYS
    extra = sorted(str(k) for k in tree if k not in known)
    if extra:
        raise UnsupportedCheckpointError(
            f"{path}: holds {extra}, written for tensor-parallel, vocabulary-padded or expert-parallel models "
            "(Megatron-DeepSpeed, AutoTP, AutoEP); dsckpt reads universal checkpoints of data-parallel models only")
    ref = tree.get("param")
    if not isinstance(ref, TensorRef):
        raise CorruptCheckpointError(f"{path}: no tensor under 'param'; the file is not a universal checkpoint "
                                     "state file")
    return ("param",), ref


def _is_step(x: object) -> bool:
    """A ``step.pt``'s content: a tensor (Adam's), or a Python int where the optimizer keeps one (FusedLamb,
    DeepSpeedCPULion, FusedAdam under FP16_Optimizer; ``ds_to_universal`` saves the group's step as it is)."""
    return isinstance(x, TensorRef) or (isinstance(x, int) and not isinstance(x, bool))


def _state_names(tag_dir: Path, names: list[str]) -> tuple[tuple[str, ...], bool]:
    """The optimizer state keys of the folder (every ``<key>.pt`` beside ``fp32.pt`` in any param's folder,
    Adam's first; Adam's own when none is there, so that a conversion stopped before them is reported) and
    whether any param folder holds ``step.pt``."""
    found: dict[str, None] = {}
    has_step = False
    for name in names:
        pdir = _param_dir(tag_dir, name)
        if not pdir.is_dir():
            continue
        for f in sorted(pdir.iterdir()):
            if f.suffix == ".pt" and f.name not in ("fp32.pt", STEP_FILE):
                found[f.stem] = None
            has_step = has_step or f.name == STEP_FILE
    keys = [k for _, k, _ in STATE_FILES[1:] if k in found] + [k for k in found if k not in ("exp_avg", "exp_avg_sq")]
    return tuple(keys) if keys else tuple(k for _, k, _ in STATE_FILES[1:] if k is not None), has_step


def read_universal(root: Path, tag: str, tag_dir: Path, cache: FileCache) -> LogicalCheckpoint:
    files = classify_files(root, tag, tag_dir)
    if files.layer_files or files.layer_expert_to_files or files.ep_mp_to_expp_optim_states:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': a universal checkpoint of a pipeline-parallel or Mixture-of-Experts model, which is not "
            "supported; dsckpt reads universal checkpoints of data-parallel models only")
    if files.dp_mp_to_optim_states:
        raise CorruptCheckpointError(
            f"'{tag_dir}' holds both a universal '{UNIVERSAL_DIR}/' folder and ZeRO optimizer files "
            f"({next(iter(files.dp_mp_to_optim_states.values())).name}); ds_to_universal writes no optimizer files "
            "there, so they come from another save: remove one of the two")
    tp = files.mp_world_size
    opt_path = tag_dir / UNIVERSAL_DIR / UNIVERSAL_OPTIMIZER_STATE
    opt = cache.tree(opt_path)
    if not isinstance(opt, Mapping):
        raise CorruptCheckpointError(f"{opt_path}: expected a dict, found a bare tensor")
    zero3 = bool(files.dp_mp_to_zero3_model_states)
    if zero3:
        ms_files = files.dp_mp_to_zero3_model_states
        ms_path = ms_files.get((0, 0), None)
    else:
        ms_files = {}
        ms_path = files.mp_to_model_states.get(0)
    if ms_path is None:
        want = "zero_pp_rank_0_mp_rank_00_model_states.pt" if zero3 else \
            "mp_rank_00_model_states.pt (ZeRO-1/2) or zero_pp_rank_*_mp_rank_00_model_states.pt (ZeRO-3)"
        raise IncompleteCheckpointError(
            f"'{tag_dir}' has a universal '{UNIVERSAL_DIR}/' folder but no {want}: ds_to_universal copies the source's "
            "model-states files there and DeepSpeed's loader reads them; copy them from the source checkpoint")
    ms = cache.tree(ms_path)
    if not isinstance(ms, Mapping):
        raise CorruptCheckpointError(f"{ms_path}: expected a dict, found a bare tensor")
    if ms.get("num_experts") is not None and not ms.get("ds_autoep_layers"):
        raise UnsupportedCheckpointError(f"{ms_path}: a native Mixture-of-Experts model; universal checkpoints of "
                                         "deepspeed.moe models are not supported (AutoEP ones are)")
    meta = metadata_from_model_states(ms)
    if (meta.pp_degree > 1 or ms.get("module", {}) is None) and not zero3:
        return _read_pipeline_universal(root, tag, tag_dir, files, opt, opt_path, meta, cache)
    if meta.pp_degree > 1 or ms.get("module", {}) is None:
        # ds_to_universal copies a pipeline run's mp_rank_{stage * tp + t} files (module None) but no layer files
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': a universal checkpoint of a pipeline-parallel run (pipeline {meta.pp_degree} x tensor "
            f"{meta.tp_degree}), which is not supported yet; read the checkpoint it was converted from instead")
    param_shapes = ms.get("param_shapes")
    if not isinstance(param_shapes, list) or not all(isinstance(g, Mapping) for g in param_shapes):
        raise CorruptCheckpointError(f"{ms_path}: no 'param_shapes' list; not a ZeRO model-states file")

    for shapes in param_shapes:
        for name in shapes:
            _param_dir(tag_dir, str(name))
    # AutoEP: ds_to_universal writes each stacked expert param whole ([num_experts, ...], with "is_expert_param" and
    # "ep_num_experts"); the copied model states list it under the local shape and carry the record.
    autoep = None
    extra_shared: dict[str, str] = {}
    if ms.get("ds_autoep_layers"):
        from .autoep import autoep_layout_from_record, router_aliases

        local = {str(n): tuple(int(x) for x in shp) for shapes in param_shapes for n, shp in shapes.items()}
        record = ms["ds_autoep_layers"]
        named = {str(n) for e in record if isinstance(e, Mapping) for n in
                 ((e.get("affine_maps") or {}).get("params") or {})} if isinstance(record, list) else set()
        autoep = autoep_layout_from_record(record, {n: local[n] for n in named if n in local}, where=ms_path,
                                           world=meta.dp_world_size or 1, stage=3 if zero3 else 2,
                                           preset=((meta.ds_config or {}).get("expert_parallel") or {}).get(
                                               "preset_model"))
        if not zero3:
            extra_shared = router_aliases(ms.get("module") or {}, set(local), autoep.layers)
    # Module side (16-bit copies of ZeRO-1/2 sources, frozen params, buffers, tied names) of every TP rank, local
    # slices mapped to full tensors by the TP record; trainable params' fp32 and moments then come whole from zero/.
    def rank_ms(t: int) -> Path:
        return ms_files[(0, t)] if zero3 else files.mp_to_model_states[t]

    absent = [t for t in range(tp) if (zero3 and (0, t) not in ms_files) or (not zero3 and t not in
                                                                            files.mp_to_model_states)]
    if absent:
        raise IncompleteCheckpointError(
            f"'{tag_dir}' is a universal checkpoint of a tensor-parallel run ({tp} TP ranks) missing the model-states "
            f"file of TP rank(s) {absent}; copy them from the source checkpoint")
    world = meta.dp_world_size or ((max(d for d, _ in ms_files) + 1) if zero3 else 1)
    if zero3:
        expect_dp_ranks(files, "ZeRO-3 model-state", ms_files, world)
    per_rank = [_rank_module_entries(rank_ms(t), [ms_files[(d, t)] for d in range(world)] if zero3 else [],
                                     meta.buffer_names, zero3, cache, extra_shared) for t in range(tp)]
    tp_layout = None
    from .tensor_parallel import UNIVERSAL_CHECKPOINT_INFO, combine_entries, is_megatron_record

    # at TP 1 too where a Megatron-style record says which vocabulary rows of the module copies are padding
    # (ds_to_universal cuts them from the merged tensors at any TP size, writing vocab_tensor)
    if tp > 1 or is_megatron_record(ms.get(UNIVERSAL_CHECKPOINT_INFO)):
        module_entries, tp_layout = combine_entries(per_rank, ms.get(UNIVERSAL_CHECKPOINT_INFO), where=str(ms_path))
    else:
        module_entries = per_rank[0]

    trainable: dict[str, TensorEntry] = {}
    missing: list[str] = []
    state_files: list[Path] = []
    step_ref: TensorRef | int | None = None
    module = ms.get("module") or {}
    state_names, has_step = _state_names(tag_dir, [str(n) for shapes in param_shapes for n in shapes])
    for g, shapes in enumerate(param_shapes):
        for name in shapes:
            name = str(name)
            side = module_entries[name]
            shape = side.shape
            cut = autoep.name_to_cut.get(name) if autoep is not None else None
            if cut is not None:
                shape = cut.full_shape
            pdir = _param_dir(tag_dir, name)
            pieces = []
            for role, state_key, fname in ((Role.MASTER, None, "fp32.pt"),
                                           *((Role.OPTIM_STATE, k, f"{k}.pt") for k in state_names)):
                path = pdir / fname
                if not path.is_file():
                    missing.append(f"{UNIVERSAL_DIR}/{name}/{fname}")
                    continue
                pieces.append(_state_piece(path, cache, tp_layout is not None, name, shape, role, state_key,
                                           cut.full_shape[0] if cut is not None else None))
                state_files.append(path)
            if not zero3:
                step_path = pdir / STEP_FILE
                if step_path.is_file():
                    state_files.append(step_path)
                    ref = cache.tree(step_path)
                    if step_ref is None and _is_step(ref):
                        step_ref = ref
                elif has_step:
                    missing.append(f"{UNIVERSAL_DIR}/{name}/{STEP_FILE}")
            # vocabulary padding: only the module copies (model-states files) keep it; ds_to_universal cut the rest
            trainable[name] = TensorEntry(name, shape, Kind.PARAM, True, (*pieces, *side.pieces), group=g,
                                          padding=side.padding, padding_rows=side.padding_rows)
    if autoep is not None and zero3:
        from .autoep import placeholder_router_aliases

        module_entries = {**module_entries, **placeholder_router_aliases(module, module_entries, autoep.layers)}
    if missing:
        shown = first_of(missing, 8)
        raise IncompleteCheckpointError(
            f"'{tag_dir}' is a universal checkpoint missing {len(missing)} state file(s): {shown}. The conversion "
            "was probably interrupted; run ds_to_universal (or dsckpt reshard --universal) again")

    entries = {n: trainable.get(n, e) for n, e in module_entries.items()}
    entries = {n: alias_entry(n, entries[e.tied_to]) if e.tied_to is not None else e for n, e in entries.items()}
    if zero3:
        step = step_of((opt.get(OSD) or {}).get("state") if isinstance(opt.get(OSD), Mapping) else None)
        stage, wrapper = 3, "DeepSpeedZeroOptimizer_Stage3"
        sample = next((r.dtype_name for r in (ms.get("frozen_param_fragments") or {}).values()
                       if isinstance(r, TensorRef)), None)
    else:
        step = int_or_none(step_ref) if step_ref is not None else None
        zs = opt.get("zero_stage")
        if isinstance(zs, DeepSpeedEnum):
            stage, wrapper = int(zs.value), "DeepSpeedZeroOptimizer"
        else:  # BF16_Optimizer files have no zero_stage (bf16_optimizer.py:629-643)
            stage, wrapper = int(((meta.ds_config or {}).get("zero_optimization") or {}).get("stage", 1)), \
                "BF16_Optimizer"
        sample = next((r.dtype_name for n, r in module.items()
                       if isinstance(r, TensorRef) and n not in meta.buffer_names and is_floating(r.dtype_name)), None)

    extra_files = sorted(p for p in (tag_dir / UNIVERSAL_DIR).glob("*/*.pt") if p not in set(state_files))
    all_files = sorted({*files.all_files(), opt_path, *state_files, *extra_files})
    return LogicalCheckpoint(
        root=root, tag=tag, tag_dir=tag_dir, layout=f"universal from zero{stage}", zero_stage=stage,
        precision=precision_of(meta.ds_config, sample),
        dp_world_size=world, pp_world_size=1, tp_world_size=tp, ds_version=meta.ds_version,
        global_steps=meta.global_steps, global_samples=meta.global_samples, optimizer_step=step,
        optimizer_wrapper=wrapper, entries=tuple(order_like_module(entries, list(module)) if autoep is None else
                                                 entry_order(entries, list(module), autoep.layers)),
        files=tuple(all_files), ds_config=meta.ds_config, tensor_parallel=tp_layout, autoep=autoep,
        notes=(("DeepSpeed universal checkpoint: loads with \"checkpoint\": {\"load_universal\": true} on any "
               f"data-parallel size (saved on {world}); DeepSpeed's loader restores the trainable params and Adam "
               "state only, not buffers or frozen params"),),
    )


def _read_pipeline_universal(root: Path, tag: str, tag_dir: Path, files: Any, opt: Mapping[str, Any], opt_path: Path,
                             meta: Any, cache: FileCache) -> LogicalCheckpoint:
    """The universal folder of a pipeline run: ds_to_universal copies each stage's
    ``mp_rank_{s}_model_states.pt`` (``module`` None, ``param_shapes`` of the stage) and writes ``zero/<name>/`` for
    every trainable param (a tied module's once), but no layer files: so there are no buffers, frozen params or
    16-bit copies, only the trainable params' fp32 masters and moments. With tensor parallelism (Megatron-DeepSpeed,
    model-parallel rank ``stage * tp + t``) the copied files' ``param_shapes`` are TP-local and each state file holds
    the merged tensor (vocabulary padding cut) with its TP keys: its shape is the file's."""
    tp = max(1, meta.tp_degree)
    entries: dict[str, TensorEntry] = {}
    state_files: list[Path] = []
    missing: list[str] = []
    step_ref: TensorRef | int | None = None
    for s in sorted(files.mp_to_model_states):
        ms = cache.tree(files.mp_to_model_states[s])
        shapes_groups = ms.get("param_shapes") if isinstance(ms, Mapping) else None
        if not isinstance(shapes_groups, list) or not all(isinstance(g, Mapping) for g in shapes_groups):
            raise CorruptCheckpointError(f"{files.mp_to_model_states[s]}: no 'param_shapes' list; not a ZeRO "
                                         "model-states file")
        for g, shapes in enumerate(shapes_groups):
            for name, shp in shapes.items():
                name = str(name)
                if name in entries:
                    continue
                shape = tuple(int(x) for x in shp)
                pdir = _param_dir(tag_dir, name)
                if tp > 1 and (pdir / STATE_FILES[0][2]).is_file():
                    shape = tuple(_state_key(pdir / STATE_FILES[0][2], cache, True)[1].shape)
                pieces = []
                for role, state_key, fname in STATE_FILES:
                    path = pdir / fname
                    if not path.is_file():
                        missing.append(f"{UNIVERSAL_DIR}/{name}/{fname}")
                        continue
                    pieces.append(_state_piece(path, cache, tp > 1, name, shape, role, state_key))
                    state_files.append(path)
                step_path = pdir / STEP_FILE
                if step_path.is_file():
                    state_files.append(step_path)
                    ref = cache.tree(step_path)
                    if step_ref is None and _is_step(ref):
                        step_ref = ref
                else:
                    missing.append(f"{UNIVERSAL_DIR}/{name}/{STEP_FILE}")
                entries[name] = TensorEntry(name, shape, Kind.PARAM, True, tuple(pieces), group=g)
    if missing:
        shown = first_of(missing, 8)
        raise IncompleteCheckpointError(
            f"'{tag_dir}' is a universal checkpoint missing {len(missing)} state file(s): {shown}. The conversion "
            "was probably interrupted; run ds_to_universal (or dsckpt reshard --universal) again")
    zs = opt.get("zero_stage")
    if isinstance(zs, DeepSpeedEnum):
        stage, wrapper = int(zs.value), "DeepSpeedZeroOptimizer"
    else:
        stage, wrapper = int(((meta.ds_config or {}).get("zero_optimization") or {}).get("stage", 1)), "BF16_Optimizer"
    extra_files = sorted(p for p in (tag_dir / UNIVERSAL_DIR).glob("*/*.pt") if p not in set(state_files))
    pp = len(files.mp_to_model_states) // tp
    return LogicalCheckpoint(
        root=root, tag=tag, tag_dir=tag_dir, layout=f"universal from zero{stage}", zero_stage=stage,
        precision=precision_of(meta.ds_config, None), dp_world_size=meta.dp_world_size or 1, pp_world_size=pp,
        tp_world_size=tp, ds_version=meta.ds_version, global_steps=meta.global_steps,
        global_samples=meta.global_samples, optimizer_step=int_or_none(step_ref) if step_ref is not None else None,
        optimizer_wrapper=wrapper, entries=tuple(entries.values()),
        files=tuple(sorted({*files.all_files(), opt_path, *state_files, *extra_files})), ds_config=meta.ds_config,
        notes=((f"DeepSpeed universal checkpoint of a {pp}-stage pipeline run"
                + (f" with tensor parallelism {tp} (merged tensors)" if tp > 1 else "")
                + ": the trainable params' fp32 masters and "
                "Adam state only (ds_to_universal copies no layer files, so no buffers, frozen params or 16-bit "
                "copies); loads with \"checkpoint\": {\"load_universal\": true}"),),
    )


def _rank_module_entries(ms_path: Path, model_paths: list[Path], buffer_names: tuple[str, ...], zero3: bool,
                         cache: FileCache, extra_shared: Mapping[str, str] | None = None) -> dict[str, TensorEntry]:
    """One (TP) rank's copied model-states file(s) as entries: trainable params with their 16-bit module copy
    (ZeRO-1/2 sources; none at ZeRO-3) and local shapes, frozen params, tied aliases, buffers."""
    ms = cache.tree(ms_path)
    param_shapes = ms.get("param_shapes") if isinstance(ms, Mapping) else None
    if not isinstance(param_shapes, list) or not all(isinstance(g, Mapping) for g in param_shapes):
        raise CorruptCheckpointError(f"{ms_path}: no 'param_shapes' list; not a ZeRO model-states file")
    module = ms.get("module") or {}
    trainable: dict[str, TensorEntry] = {}
    for g, shapes in enumerate(param_shapes):
        for name, shape in shapes.items():
            name = str(name)
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            lowp = module.get(name)
            pieces = (module_piece(ms_path, name, lowp),) if (
                not zero3 and isinstance(lowp, TensorRef) and lowp.numel == numel) else ()
            trainable[name] = TensorEntry(name, shape, Kind.PARAM, True, pieces, group=g)
    if extra_shared:  # AutoEP's router alias, proven by value (readers.autoep.router_aliases)
        ms = {**ms, "shared_params": {**(ms.get("shared_params") or {}), **extra_shared}}
    if zero3:
        return {**trainable, **zero3_module_side_entries(ms_path, ms, model_paths, buffer_names, trainable, cache)}
    return module_side_entries(ms_path, ms, buffer_names, trainable)
