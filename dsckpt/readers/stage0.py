"""ZeRO stage 0 (no partitioning): everything is in ``mp_rank_00_model_states.pt``.

Where the fp32 master lives (DEEPSPEED-NOTES 1.6):

* fp32 training: the module weights are the master; ``optimizer`` is a plain torch state dict.
* fp16/bf16 with ``FP16_Optimizer`` (fused; DeepSpeed's default for Adam, also stage-0 bf16):
  ``optimizer['fp32_groups_flat'][g]`` is the unpadded flat fp32 copy of group ``g``. No names are
  stored, but the saved module tensors are views into the 16-bit flat buffer of their group with the
  same layout, so a param's ``storage_offset`` is its offset in ``fp32_groups_flat[g]``.
* ``FP16_UnfusedOptimizer`` (e.g. SGD): ``optimizer['fp32_groups']`` lists per-param fp32 tensors in
  optimizer order.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..layout import CheckpointFiles
from ..model import Fragment, Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from ..safe_load import TensorRef
from .common import (
    FileCache,
    alias_entry,
    buffer_entries,
    is_floating,
    metadata_from_model_states,
    module_piece,
    order_like_module,
    precision_of,
    step_of,
)

__all__ = ["read_stage0", "module_params_and_aliases"]


def module_params_and_aliases(module: Mapping[str, Any], buffer_names: set[str]) -> tuple[list[str], dict[str, str]]:
    """Unique param names in module order, and ``alias -> source`` for tied params (same view)."""
    first: dict[tuple[Any, ...], str] = {}
    unique: list[str] = []
    aliases: dict[str, str] = {}
    for name, ref in module.items():
        if name in buffer_names or not isinstance(ref, TensorRef):
            continue
        view = (ref.storage.path, ref.storage.key, ref.storage_offset, ref.shape, ref.stride)
        if view in first and ref.numel:
            aliases[name] = first[view]
        else:
            first[view] = name
            unique.append(name)
    return unique, aliases


def _moment_pieces(path: Path, state_key: tuple[Any, ...], state: Any, src_offset: int, numel: int) -> list[Piece]:
    pieces = []
    if isinstance(state, Mapping):
        for role in (Role.EXP_AVG, Role.EXP_AVG_SQ):
            ref = state.get(role.value)
            if isinstance(ref, TensorRef) and src_offset + numel <= ref.numel:
                pieces.append(Piece(role, "float32", (Fragment(path, (*state_key, role.value), src_offset, numel, 0),)))
    return pieces


def read_stage0(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    module: Mapping[str, Any] = ms["module"]
    buffers = set(meta.buffer_names)
    unique, aliases = module_params_and_aliases(module, buffers)
    optimizer = ms.get("optimizer")
    entries: dict[str, TensorEntry] = {}
    step: int | None = None
    if isinstance(optimizer, Mapping) and "fp32_groups_flat" in optimizer:
        wrapper = "FP16_Optimizer"
        entries = _fused(ms_path, module, unique, optimizer)
        step = step_of((optimizer.get("optimizer_state_dict") or {}).get("state"))
    elif isinstance(optimizer, Mapping) and "fp32_groups" in optimizer:
        wrapper = "FP16_UnfusedOptimizer"
        entries = _unfused(ms_path, module, unique, optimizer)
        step = step_of((optimizer.get("optimizer_state_dict") or {}).get("state"))
    else:
        wrapper = "torch optimizer" if isinstance(optimizer, Mapping) else "none saved"
        entries = _plain(ms_path, module, unique, optimizer if isinstance(optimizer, Mapping) else None)
        step = step_of(optimizer.get("state")) if isinstance(optimizer, Mapping) else None
    for alias, source in aliases.items():
        entries[alias] = alias_entry(alias, entries[source])
    for e in buffer_entries(ms_path, module, meta.buffer_names):
        entries[e.name] = e
    sample = next((module[n].dtype_name for n in unique if is_floating(module[n].dtype_name)), None)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="stage0", zero_stage=0,
        precision=precision_of(meta.ds_config, sample), dp_world_size=meta.dp_world_size or 1,
        pp_world_size=1, tp_world_size=1, ds_version=meta.ds_version, global_steps=meta.global_steps,
        global_samples=meta.global_samples, optimizer_step=step, optimizer_wrapper=wrapper,
        entries=tuple(order_like_module(entries, list(module))), files=tuple(files.all_files()),
        ds_config=meta.ds_config,
    )


def _fused(path: Path, module: Mapping[str, Any], unique: list[str], optimizer: Mapping[str, Any]) -> dict[str, TensorEntry]:
    flats = optimizer["fp32_groups_flat"]
    inner_state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    state_keys = sorted(inner_state)
    by_storage: dict[tuple[Path, str], list[str]] = {}
    for name in unique:
        ref = module[name]
        by_storage.setdefault((ref.storage.path, ref.storage.key), []).append(name)
    assigned: dict[tuple[Path, str], int] = {}
    for g, flat in enumerate(flats):
        if not isinstance(flat, TensorRef):
            raise CorruptCheckpointError(f"{path}: fp32_groups_flat[{g}] is not a tensor")
        # The 16-bit flat buffer of group g has exactly as many elements as its fp32 copy; ties are
        # broken by module order (DeepSpeed builds groups in the order the params were passed).
        for skey, names in by_storage.items():
            ref = module[names[0]]
            if skey not in assigned and ref.storage.numel == flat.numel and len(names) > 0:
                assigned[skey] = g
                break
        else:
            raise CorruptCheckpointError(
                f"{path}: no module tensors lie in a {flat.numel}-element flat buffer to match "
                f"fp32_groups_flat[{g}]; cannot tell which params it holds"
            )
    entries = {}
    for skey, names in by_storage.items():
        group = assigned.get(skey)
        for name in names:
            ref = module[name]
            pieces = [module_piece(path, name, ref)]
            if group is None:
                entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, tuple(pieces))
                continue
            g = group
            off = ref.storage_offset
            master = Piece(Role.MASTER, "float32",
                           (Fragment(path, ("optimizer", "fp32_groups_flat", g), off, ref.numel, 0),))
            moments = []
            if g < len(state_keys):
                moments = _moment_pieces(path, ("optimizer", "optimizer_state_dict", "state", state_keys[g]),
                                         inner_state[state_keys[g]], off, ref.numel)
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, True, (master, *moments, *pieces), group=g)
    return entries


def _unfused(path: Path, module: Mapping[str, Any], unique: list[str], optimizer: Mapping[str, Any]) -> dict[str, TensorEntry]:
    inner_state = (optimizer.get("optimizer_state_dict") or {}).get("state") or {}
    fp32 = [(g, i, t) for g, group in enumerate(optimizer["fp32_groups"]) for i, t in enumerate(group)]
    entries = {}
    k = 0
    for name in unique:
        ref = module[name]
        pieces: list[Piece] = [module_piece(path, name, ref)]
        if k < len(fp32) and isinstance(fp32[k][2], TensorRef) and fp32[k][2].shape == ref.shape:
            g, i, master = fp32[k]
            pieces.insert(0, Piece(Role.MASTER, "float32",
                                   (Fragment(path, ("optimizer", "fp32_groups", g, i), 0, master.numel, 0),)))
            if k in inner_state:
                pieces[1:1] = _moment_pieces(path, ("optimizer", "optimizer_state_dict", "state", k),
                                             inner_state[k], 0, ref.numel)
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, True, tuple(pieces), group=g)
            k += 1
        else:
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, tuple(pieces))
    return entries


def _plain(path: Path, module: Mapping[str, Any], unique: list[str], optimizer: Mapping[str, Any] | None) -> dict[str, TensorEntry]:
    """fp32: module weights are the master. Map optimizer indices to params by order and shape."""
    indices: list[tuple[int, Any]] = []
    if optimizer is not None:
        for g, group in enumerate(optimizer.get("param_groups") or []):
            indices += [(g, idx) for idx in group.get("params", [])]
    state = (optimizer or {}).get("state") or {}
    entries = {}
    k = 0
    for name in unique:
        ref = module[name]
        trainable = optimizer is None
        moments: list[Piece] = []
        group = None
        if k < len(indices):
            g, idx = indices[k]
            st = state.get(idx)
            exp_avg = st.get("exp_avg") if isinstance(st, Mapping) else None
            if not isinstance(exp_avg, TensorRef) or exp_avg.shape == ref.shape:
                # A param handed to the optimizer that has no state after steps were taken never
                # received a gradient: it is frozen (requires_grad=False params passed via
                # model.parameters()).
                trainable = st is not None or not state
                group = g if trainable else None
                moments = _moment_pieces(path, ("optimizer", "state", idx), st, 0, ref.numel)
                k += 1
        entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, trainable,
                                    (module_piece(path, name, ref), *moments), group=group)
    return entries
