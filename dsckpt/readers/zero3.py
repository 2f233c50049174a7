"""ZeRO stage 3: per-rank model-states and optimizer files, per-parameter partitions.

``zero_pp_rank_{d}_mp_rank_00_model_states.pt`` on every rank holds 0-element placeholders for params,
full buffers, ``param_shapes`` (one OrderedDict per fp32 sub-group) and this rank's
``frozen_param_fragments``. ``fp32_flat_groups[s]`` in the optimizer file of rank ``d`` is the
concatenation of rank ``d``'s ``ceil(numel / ws)``-element piece of every param of sub-group ``s``
(DEEPSPEED-NOTES 1.3, 1.5; partition_parameters.py:1690-1696).
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from .. import nvme_swap
from ..errors import CorruptCheckpointError
from ..layout import OSD, CheckpointFiles, expect_dp_ranks
from ..model import Fragment, Kind, LogicalCheckpoint, OptimizerGroup, Piece, Role, TensorEntry
from ..partition import zero3_partition_numel, zero3_spans
from ..tensor_ref import TensorRef
from .common import (
    FileCache,
    alias_entry,
    buffer_entries,
    lookup,
    metadata_from_model_states,
    optimizer_groups,
    optimizer_type,
    order_like_module,
    precision_of,
    step_of,
)

__all__ = ["read_zero3", "zero3_module_side_entries"]



def _shape(shape: Any) -> tuple[int, ...]:
    return tuple(int(s) for s in shape)


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for s in shape:
        n *= s
    return n


def read_zero3(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_files = files.dp_mp_to_zero3_model_states
    ms0_path = ms_files[(0, 0)]
    ms0 = cache.tree(ms0_path)
    meta = metadata_from_model_states(ms0)
    world = meta.dp_world_size or (max(d for d, _ in ms_files) + 1)
    expect_dp_ranks(files, "ZeRO-3 model-state", ms_files, world)
    expect_dp_ranks(files, "optimizer-state", files.dp_mp_to_optim_states, world)
    model_paths = [ms_files[(d, 0)] for d in range(world)]
    optim_paths = [files.dp_mp_to_optim_states[(d, 0)] for d in range(world)]
    param_shapes = ms0.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise CorruptCheckpointError(f"{ms0_path}: no 'param_shapes'; not a ZeRO-3 model-states file")

    osds = [cache.tree(p).get(OSD) for p in optim_paths]
    for p, osd in zip(optim_paths, osds):
        if not isinstance(osd, Mapping) or "fp32_flat_groups" not in osd:
            raise CorruptCheckpointError(f"{p}: no 'fp32_flat_groups'; not a ZeRO-3 optimizer file")
        if len(osd["fp32_flat_groups"]) != len(param_shapes):
            raise CorruptCheckpointError(
                f"{p}: {len(osd['fp32_flat_groups'])} fp32 sub-groups, 'param_shapes' in {ms0_path.name} "
                f"has {len(param_shapes)}"
            )
    inner = osds[0].get(OSD) or {}
    state_keys = sorted((inner.get("state") or {}).keys())

    sub_states = zero3_state_keys(optim_paths, osds, state_keys)
    where = _subgroup_sources(files, ms0, param_shapes, optim_paths, osds, state_keys, sub_states, world, cache)
    entries: dict[str, TensorEntry] = {}
    for s, shapes in enumerate(param_shapes):
        offset = 0
        for name, shape in shapes.items():
            shape = _shape(shape)
            numel = _numel(shape)
            spans = zero3_spans(numel, world, offset)
            pieces = [Piece(Role.MASTER, "float32", tuple(
                Fragment(*where[(sp.rank, s, None)], sp.src_offset, sp.numel, sp.dst_offset, sp.rank)
                for sp in spans))]
            if s < len(state_keys):
                for sk, dtype in sub_states[s].items():
                    pieces.append(Piece(Role.OPTIM_STATE, dtype, tuple(
                        Fragment(*where[(sp.rank, s, sk)], sp.src_offset, sp.numel, sp.dst_offset, sp.rank)
                        for sp in spans), state_key=sk))
            entries[name] = TensorEntry(name, shape, Kind.PARAM, True, tuple(pieces), group=s)
            offset += zero3_partition_numel(numel, world)
        for rank in range(world):
            path, key = where[(rank, s, None)]
            stored = cache.tensor(path, key) if key == () else lookup(cache.tree(path), key, path)
            if not isinstance(stored, TensorRef) or stored.numel < offset:
                raise CorruptCheckpointError(
                    f"{path}: fp32 sub-group {s} holds "
                    f"{stored.numel if isinstance(stored, TensorRef) else 0} elements, 'param_shapes' "
                    f"needs {offset}"
                )

    excluded_ties: list[tuple[str, str]] = []
    entries.update(zero3_module_side_entries(ms0_path, ms0, model_paths, meta.buffer_names, entries, cache,
                                             excluded_ties))
    module0 = ms0.get("module") or {}
    sample = next((ref.dtype_name for ref in (ms0.get("frozen_param_fragments") or {}).values()
                   if isinstance(ref, TensorRef)), None)
    if sample is None:
        sample = next((ref.dtype_name for n, ref in module0.items()
                       if isinstance(ref, TensorRef) and n not in meta.buffer_names), None)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="zero3", zero_stage=3,
        precision=precision_of(meta.ds_config, sample), dp_world_size=world, pp_world_size=1,
        tp_world_size=1, ds_version=meta.ds_version, global_steps=meta.global_steps,
        global_samples=meta.global_samples, optimizer_step=step_of(inner.get("state")),
        optimizer_wrapper="DeepSpeedZeroOptimizer_Stage3",
        entries=tuple(order_like_module(entries, list(module0))),
        files=tuple(files.all_files()), ds_config=meta.ds_config, excluded_ties=tuple(excluded_ties),
        optimizer_groups=zero3_optimizer_groups(inner, param_shapes), optimizer_type=optimizer_type(meta.ds_config),
    )


def zero3_state_keys(optim_paths: list[Path], osds: list[Any], state_keys: list[Any]) -> list[dict[str, str]]:
    """Per fp32 sub-group: the keys (and dtypes) of its per-element optimizer states, a tensor of the sub-group's
    partition length on every rank (DeepSpeed's rule, tensor_fragment.py), in the optimizer's order."""
    from .zero12 import per_element_keys

    out = []
    for s, key in enumerate(state_keys):
        found: dict[str, str] | None = None
        swapped_keys: dict[str, str] = {}
        for path, osd in zip(optim_paths, osds):
            flat = osd["fp32_flat_groups"][s] if s < len(osd["fp32_flat_groups"]) else None
            st = ((osd.get(OSD) or {}).get("state") or {}).get(key)
            if isinstance(flat, TensorRef) and flat.numel == 0 and isinstance(st, Mapping):
                # swapped to NVMe: master and states saved as empty tensors, the values are in the swap files
                swapped_keys = {str(k): "float32" for k, v in st.items()
                                if isinstance(v, TensorRef) and len(v.shape) == 1 and v.numel == 0}
                continue
            got = per_element_keys(st, flat.numel if isinstance(flat, TensorRef) else 0)
            if found is None:
                found = got
            elif got != found:
                numel = flat.numel if isinstance(flat, TensorRef) else 0
                raise CorruptCheckpointError(
                    f"{path}: fp32 sub-group {s} holds {numel} elements with per-element optimizer states "
                    f"{sorted(got)}, rank 0's {sorted(found)}; the file is damaged or the optimizer files come from "
                    "different runs")
        out.append(found if found is not None else swapped_keys)
    return out


def zero3_ds_ids(ms0: Mapping[str, Any]) -> dict[str, int]:
    """ZeRO-3's ``ds_id`` of every param: its position among the module's own params (tied aliases and
    buffers left out), the order DeepSpeed partitions them in (stage3.py:1174)."""
    module = ms0.get("module") or {}
    buffers = set(ms0.get("buffer_names") or ())
    tied = set((ms0.get("shared_params") or {}).keys())
    return {n: i for i, n in enumerate(n for n in module if n not in buffers and n not in tied)}


def _subgroup_sources(files: CheckpointFiles, ms0: Mapping[str, Any], param_shapes: list[Any],
                      optim_paths: list[Path], osds: list[Any], state_keys: list[Any],
                      sub_states: list[dict[str, str]], world: int,
                      cache: FileCache) -> dict[tuple[int, int, str | None], tuple[Path, tuple[Any, ...]]]:
    """``(rank, sub-group, state key or None for the master) -> (file, key path)`` of every flat partition.

    A sub-group saved empty was swapped to NVMe: it is read from the copy of the rank's swap folder that
    ``save_checkpoint`` put in ``offloaded_tensors/rank{NN}/`` (:mod:`dsckpt.nvme_swap`)."""
    where: dict[tuple[int, int, str | None], tuple[Path, tuple[Any, ...]]] = {}
    ds_ids: dict[str, int] | None = None
    missing: list[str] = []
    for s, shapes in enumerate(param_shapes):
        names = list(shapes)
        for rank, osd in enumerate(osds):
            stored = osd["fp32_flat_groups"][s]
            keys = list(sub_states[s]) if s < len(sub_states) else []
            swapped = isinstance(stored, TensorRef) and stored.numel == 0 and bool(names) and any(
                _numel(_shape(shp)) for shp in shapes.values())
            if not swapped:
                where[(rank, s, None)] = (optim_paths[rank], (OSD, "fp32_flat_groups", s))
                if s < len(state_keys):
                    for k in keys:
                        where[(rank, s, k)] = (optim_paths[rank], (OSD, OSD, "state", state_keys[s], k))
                continue
            if ds_ids is None:
                ds_ids = zero3_ds_ids(ms0)
            if names[0] not in ds_ids or names[-1] not in ds_ids:
                raise CorruptCheckpointError(f"{optim_paths[rank]}: fp32 sub-group {s} was swapped to NVMe, and "
                                             f"its params {names[0]!r}..{names[-1]!r} are not in the module")
            sid = nvme_swap.swap_id(ds_ids[names[0]], ds_ids[names[-1]])
            folder = files.tag_dir / nvme_swap.OFFLOAD_DIR / nvme_swap.rank_dir(rank)
            where[(rank, s, None)] = (folder / nvme_swap.master_file(sid), ())
            for k in keys:
                where[(rank, s, k)] = (folder / nvme_swap.state_file(k, sid), ())
            missing += [str(p) for p, _ in (where[(rank, s, k)] for k in (None, *keys)) if not p.is_file()]
    if missing:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': fp32 sub-groups were swapped to NVMe (their optimizer-file tensors are empty), but "
            f"{len(missing)} swap file(s) are missing: {', '.join(missing[:3])}"
            + (" ..." if len(missing) > 3 else "") + "; copy the save's offloaded_tensors/ folder along with it")
    return where


def zero3_optimizer_groups(inner: Mapping[str, Any], param_shapes: list[Any]) -> tuple[OptimizerGroup, ...]:
    """The ZeRO-3 optimizer's param groups: each lists its fp32 sub-groups (``params``), whose params
    (``param_shapes``) it holds in order; its step is its first sub-group's (every sub-group steps together)."""
    groups = inner.get("param_groups")
    state = inner.get("state") or {}
    if not isinstance(groups, list) or not isinstance(state, Mapping):
        return ()
    names: list[list[str]] = []
    states: list[Any] = []
    for pg in groups:
        subs = [s for s in (pg.get("params") or []) if isinstance(s, int) and 0 <= s < len(param_shapes)]
        names.append([str(n) for s in subs for n in param_shapes[s]])
        states.append(state.get(subs[0]) if subs else None)
    return optimizer_groups(groups, names, states)


def zero3_module_side_entries(ms0_path: Path, ms0: Mapping[str, Any], model_paths: list[Path],
                              buffer_names: tuple[str, ...], trainable: Mapping[str, TensorEntry],
                              cache: FileCache,
                              excluded_ties: list[tuple[str, str]] | None = None) -> dict[str, TensorEntry]:
    """What the stage-3 model-states files of every rank hold besides the trainable params: frozen
    params (each rank's ``frozen_param_fragments``), tied aliases, buffers (a replica per rank). Also
    used for the copied model-states files of a universal checkpoint.

    ``excluded_ties``: when given, a tied alias whose source is unknown is appended there instead of being an
    error, provided the files hold no frozen param (``frozen_param_shapes`` is None: saved with
    ``exclude_frozen_parameters=True``); the alias gets no entry (its ``module`` tensor is a ZeRO-3 placeholder)."""
    world = len(model_paths)
    entries: dict[str, TensorEntry] = {}
    frozen_shapes = ms0.get("frozen_param_shapes") or {}
    for name, shape in frozen_shapes.items():
        shape = _shape(shape)
        numel = _numel(shape)
        per_rank = zero3_partition_numel(numel, world)
        frags = []
        dtype = None
        for rank, mp in enumerate(model_paths):
            ref = (cache.tree(mp).get("frozen_param_fragments") or {}).get(name)
            if not isinstance(ref, TensorRef):
                raise CorruptCheckpointError(f"{mp}: frozen param '{name}' has no fragment on rank {rank}")
            dtype = ref.dtype_name
            valid = max(0, min(per_rank, numel - rank * per_rank))
            if valid:
                frags.append(Fragment(mp, ("frozen_param_fragments", name), 0, valid, rank * per_rank, rank))
        entries[name] = TensorEntry(name, shape, Kind.PARAM, False,
                                    (Piece(Role.MODULE, dtype or "float32", tuple(frags)),))

    shared = ms0.get("shared_params") or {}
    for alias, source in shared.items():
        if source not in trainable and source not in entries:
            if excluded_ties is not None and not frozen_shapes:
                excluded_ties.append((alias, source))
                continue
            raise CorruptCheckpointError(f"{ms0_path}: tied param '{alias}' points to unknown '{source}'")
        entries[alias] = alias_entry(alias, trainable[source] if source in trainable else entries[source])

    module0 = ms0.get("module") or {}
    replicas = [(mp, cache.tree(mp).get("module") or {}, rank) for rank, mp in enumerate(model_paths) if rank]
    for e in buffer_entries(ms0_path, module0, buffer_names, replicas):
        entries[e.name] = e
    return entries
