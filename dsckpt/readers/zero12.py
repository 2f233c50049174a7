"""ZeRO stage 1/2 and ``BF16_Optimizer`` checkpoints: flat fp32 partitions per param group.

Files: ``mp_rank_00_model_states.pt`` (module copy, names, shapes, frozen, tied) and one
``[bf16_]zero_pp_rank_{d}_mp_rank_00_optim_states.pt`` per data-parallel rank
(DEEPSPEED-NOTES 1.4, 1.6). Concatenating the ranks' ``single_partition_of_fp32_groups[g]`` gives
group ``g``'s flat buffer: params in ``param_shapes[g]`` order, each followed by its
``param_alignment_paddings`` entry, padding at the tail. ZeRO's optimizer strips each rank's tail
padding on save (``group_paddings`` says how much); ``BF16_Optimizer`` keeps it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import OSD, CheckpointFiles, expect_dp_ranks
from ..model import Fragment, Kind, LogicalCheckpoint, OptimizerGroup, Piece, Role, TensorEntry
from ..partition import split_by_partitions, undo_round_robin
from ..stand_ins import DeepSpeedEnum
from ..tensor_ref import TensorRef
from .common import (
    ADAM_STATE_KEYS,
    FileCache,
    alias_entry,
    buffer_entries,
    is_floating,
    lookup,
    metadata_from_model_states,
    module_piece,
    optimizer_groups,
    optimizer_type,
    order_like_module,
    precision_of,
    step_of,
)

__all__ = ["ExpertGroups", "GroupPartitions", "group_partitions", "read_expert_groups", "module_side_entries",
           "read_zero12", "zero12_param_entries"]



class GroupPartitions:
    """Per group: every rank's partition length (padding included) and where its optimizer state lives."""

    def __init__(self, partition_numel: list[int], stored_numels: list[list[int]],
                 moment_keys: list[tuple[Any, ...] | None], state_keys: list[tuple[str, ...]] | None = None,
                 state_dtypes: list[dict[str, str]] | None = None, muon: list[bool] | None = None):
        self.partition_numel = partition_numel  # per group
        self.stored_numels = stored_numels  # per group, per rank: saved fp32 partition length
        self.moment_keys = moment_keys  # per group: key path prefix of the optimizer state of that group
        # per group: the keys of its per-element states (a tensor of the partition's length on every rank, the
        # rule of DeepSpeed's fragment API, tensor_fragment.py), in the optimizer's order; and their dtypes
        self.state_keys = state_keys if state_keys is not None else [ADAM_STATE_KEYS] * len(partition_numel)
        self.state_dtypes = state_dtypes if state_dtypes is not None else [
            dict.fromkeys(k, "float32") for k in self.state_keys]
        # per group: a Muon group (param group 'use_muon'), whose momentum_buffer holds whole params
        self.muon = muon if muon is not None else [False] * len(partition_numel)


#: Muon's state at ZeRO-1/2: per group, each Muon param's momentum WHOLE on every rank whose partition the param
#: meets (stage_1_and_2.py _muon_momentum_buffer: the concat of params_in_partition), not a partition
MUON_STATE = "momentum_buffer"


def per_element_keys(state: Any, numel: int) -> dict[str, str]:
    """The keys of a flat group's optimizer ``state`` that hold one value per element of its ``numel``-element
    partition, in the state's order, with their dtypes."""
    if not isinstance(state, Mapping) or numel <= 1:
        return {}
    return {str(k): v.dtype_name for k, v in state.items()
            if isinstance(v, TensorRef) and len(v.shape) == 1 and v.numel == numel}


def group_partitions(optim_files: list[Path], cache: FileCache, keeps_padding: bool) -> GroupPartitions:
    trees = [cache.tree(p).get(OSD) for p in optim_files]
    for path, t in zip(optim_files, trees):
        groups = t.get("single_partition_of_fp32_groups") if isinstance(t, Mapping) else None
        if not isinstance(groups, list) or not all(isinstance(r, TensorRef) for r in groups):
            raise CorruptCheckpointError(
                f"{path}: no list of tensors under '{OSD}.single_partition_of_fp32_groups'; the file is "
                "damaged or not a ZeRO-1/2 optimizer file"
            )
    n_groups = len(trees[0]["single_partition_of_fp32_groups"])
    partition_numel: list[int] = []
    stored: list[list[int]] = []
    for g in range(n_groups):
        lengths = []
        candidates = set()
        for rank, t in enumerate(trees):
            groups = t["single_partition_of_fp32_groups"]
            if len(groups) != n_groups:
                raise CorruptCheckpointError(
                    f"{optim_files[rank]}: {len(groups)} fp32 param groups, rank 0 has {n_groups}"
                )
            ref = groups[g]
            lengths.append(ref.numel)
            pads = t.get("group_paddings") or [0] * n_groups
            if not keeps_padding and not (isinstance(pads, list) and len(pads) == n_groups
                                          and all(isinstance(x, int) and x >= 0 for x in pads)):
                raise CorruptCheckpointError(
                    f"{optim_files[rank]}: 'group_paddings' is not one non-negative integer per group; "
                    "the file is damaged")
            pad = 0 if keeps_padding else int(pads[g])
            candidates.add(ref.numel + pad)
        if len(candidates) != 1:
            raise CorruptCheckpointError(
                f"'{optim_files[0].parent}': group {g} partitions disagree in size across ranks "
                f"({sorted(candidates)}); the optimizer files come from different runs"
            )
        partition_numel.append(candidates.pop())
        stored.append(lengths)
    base = trees[0].get("base_optimizer_state")
    if not isinstance(base, (list, Mapping)) or (
            isinstance(base, Mapping) and not isinstance(base.get("state") or {}, Mapping)):
        raise CorruptCheckpointError(
            f"{optim_files[0]}: no optimizer state under '{OSD}.base_optimizer_state'; the file is damaged")
    if isinstance(base, list):
        # elastic_checkpoint: base_optimizer_state[g] is group g's state with each rank's tail padding stripped
        # (stage_1_and_2.py _get_base_optimizer_state), so its per-element tensors are as long as the rank's stored
        # fp32 partition
        if len(base) != n_groups:
            raise CorruptCheckpointError(f"{optim_files[0]}: {len(base)} elastic optimizer group states for "
                                         f"{n_groups} fp32 groups; the file is damaged")
        moment_keys: list[tuple[Any, ...] | None] = [(OSD, "base_optimizer_state", g) for g in range(n_groups)]
        keys_of, dtypes = [], []
        for g in range(n_groups):
            found: dict[str, str] | None = None
            for rank, t in enumerate(trees):
                b = t.get("base_optimizer_state")
                st = b[g] if isinstance(b, list) and len(b) == n_groups else None
                if stored[g][rank] <= 1:
                    continue  # a one-element state cannot be told from a scalar
                got = per_element_keys(st, stored[g][rank])
                if found is not None and got != found:
                    raise CorruptCheckpointError(
                        f"{optim_files[rank]}: group {g}'s per-element elastic optimizer states are {sorted(got)}, "
                        f"another rank's {sorted(found)}; the optimizer files come from different runs")
                found = got
            found = found if found is not None else dict.fromkeys(ADAM_STATE_KEYS, "float32")
            keys_of.append(tuple(found))
            dtypes.append(found)
        return GroupPartitions(partition_numel, stored, moment_keys, keys_of, dtypes)
    else:
        keys = list((base.get("state") or {}).keys())
        if not all(isinstance(k, int) for k in keys):
            raise CorruptCheckpointError(f"{optim_files[0]}: optimizer state keys {keys[:4]} are not param "
                                         "indices; the file is damaged")
        state_keys = sorted(keys)
        # the state of group g is keyed by its one flat param (param_groups[g]['params'][0]): by position where
        # the groups do not say
        groups = base.get("param_groups")
        owner = [pg["params"][0] if isinstance(pg, Mapping) and isinstance(pg.get("params"), list)
                 and len(pg["params"]) == 1 else None for pg in (groups if isinstance(groups, list) else [])]
        moment_keys = []
        for g in range(n_groups):
            k = owner[g] if g < len(owner) and owner[g] is not None else (
                state_keys[g] if g < len(state_keys) else None)
            moment_keys.append((OSD, "base_optimizer_state", "state", k) if k in base["state"] else None)
        keys_of, dtypes, muon = [], [], []
        for g in range(n_groups):
            pg = groups[g] if isinstance(groups, list) and g < len(groups) else None
            muon.append(isinstance(pg, Mapping) and bool(pg.get("use_muon", False)))
            mk = moment_keys[g]
            found = per_element_keys(base["state"].get(mk[-1]) if mk is not None else None, partition_numel[g])
            if muon[g]:
                found.pop(MUON_STATE, None)
            for rank, t in enumerate(trees[1:], start=1):
                other = (t.get("base_optimizer_state") or {}).get("state") or {}
                got = per_element_keys(other.get(mk[-1]) if mk is not None else None, partition_numel[g])
                if muon[g]:
                    got.pop(MUON_STATE, None)
                if got != found:
                    raise CorruptCheckpointError(
                        f"{optim_files[rank]}: group {g}'s per-element optimizer states are {sorted(got)}, rank 0's "
                        f"{sorted(found)}; the optimizer files come from different runs")
            keys_of.append(tuple(found))
            dtypes.append(found)
        return GroupPartitions(partition_numel, stored, moment_keys, keys_of, dtypes, muon)


@dataclass(frozen=True)
class ExpertGroups:
    """The ZeRO-1/2 optimizer groups of a checkpoint with expert param groups (native MoE, AutoEP), checked to agree:
    rank 0's optimizer state, the ZeRO stage, ``param_shapes`` / optimizer param groups / ``partition_count`` (one per
    group) and every rank's partition lengths."""

    osd0: Mapping[str, Any]
    stage: int
    param_shapes: list[Any]
    param_groups: list[Any]
    partition_count: list[Any]
    parts: GroupPartitions
    bf16_optimizer: bool = False  # BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation): padding kept

    @property
    def optimizer_step(self) -> int | None:
        """The base optimizer's step."""
        return step_of(self.osd0["base_optimizer_state"].get("state"))


def read_expert_groups(optim_files: list[Path], cache: FileCache, ms: Mapping[str, Any], ms_path: Path,
                       tag_dir: Path, *, what: str, bf16_optimizer_ok: bool = False) -> ExpertGroups:
    """Open and cross-check the ZeRO-1/2 groups of a ``what`` ("Mixture-of-Experts", "AutoEP") save.
    ``BF16_Optimizer`` files (no ``zero_stage``; the ZeRO-1 layout with each partition's padding kept) are read where
    ``bf16_optimizer_ok``, else refused."""
    osd0 = cache.tree(optim_files[0]).get(OSD)
    if not isinstance(osd0, Mapping) or "single_partition_of_fp32_groups" not in osd0:
        raise CorruptCheckpointError(f"{optim_files[0]}: no 'single_partition_of_fp32_groups'; not a ZeRO-1/2 file")
    zs = osd0.get("zero_stage")
    bf16_optimizer = zs is None and bf16_optimizer_ok
    if not isinstance(zs, DeepSpeedEnum) and not bf16_optimizer:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}': {what} with BF16_Optimizer (bf16 + ZeRO-1 + fp32 gradient accumulation) is not "
            "supported yet; only DeepSpeed's ZeRO-1/2 optimizer can be read")
    param_shapes = ms.get("param_shapes")
    base = osd0.get("base_optimizer_state")
    if not isinstance(param_shapes, list) or not isinstance(base, Mapping):
        raise CorruptCheckpointError(f"{ms_path}: no 'param_shapes' or no optimizer state; not a ZeRO-1/2 {what} save")
    param_groups = base.get("param_groups") or []
    counts = osd0.get("partition_count")
    parts = group_partitions(optim_files, cache, keeps_padding=bf16_optimizer)
    n_groups = len(parts.partition_numel)
    if len(param_shapes) != n_groups or len(param_groups) != n_groups or not isinstance(counts, list) \
            or len(counts) != n_groups:
        raise CorruptCheckpointError(
            f"'{tag_dir}': {len(param_shapes)} groups in 'param_shapes', {n_groups} fp32 groups, "
            f"{len(param_groups)} optimizer param groups and partition_count {counts}; the files disagree")
    stage = int(zs.value) if isinstance(zs, DeepSpeedEnum) else 1
    return ExpertGroups(osd0, stage, param_shapes, list(param_groups), counts, parts, bf16_optimizer)


def zero12_param_entries(
    *,
    model_states: Path,
    optim_files: list[Path],
    cache: FileCache,
    keeps_padding: bool,
    name_prefix: str = "",
    module_names_to_refs: Mapping[str, tuple[Path, tuple[Any, ...], TensorRef]] | None = None,
    param_shapes: list[Any] | None = None,
) -> dict[str, TensorEntry]:
    """Entries for every trainable param of a stage-1/2 (or BF16_Optimizer) rank set.

    ``module_names_to_refs`` gives each param's module copy (file, key, ref); by default the
    ``module`` of ``model_states``. ``param_shapes``: the flat order where the model states do not hold it
    (``BF16_Optimizer`` without ZeRO saves ``None``: :mod:`.pipeline` rebuilds it).
    """
    ms = cache.tree(model_states)
    if param_shapes is None:
        param_shapes = ms.get("param_shapes")
    if not isinstance(param_shapes, list):
        raise CorruptCheckpointError(f"{model_states}: no 'param_shapes'; not a ZeRO-1/2 model-states file")
    parts = group_partitions(optim_files, cache, keeps_padding)
    osd0 = cache.tree(optim_files[0])[OSD]
    # None in DeepSpeed 0.10.3-0.18.9 files (seen in 0.10.3, 0.12.6, 0.14.5, 0.16.9, 0.18.9): they predate
    # parameter_alignment, so params are packed with no padding between them
    align_pads = osd0.get("param_alignment_paddings")
    if len(param_shapes) != len(parts.partition_numel):
        raise CorruptCheckpointError(
            f"{model_states}: {len(param_shapes)} param groups in 'param_shapes' but "
            f"{len(parts.partition_numel)} fp32 groups in {optim_files[0].name}"
        )
    if align_pads is not None and not (isinstance(align_pads, list) and all(
            isinstance(p, list) and all(isinstance(x, int) and x >= 0 for x in p) for p in align_pads)):
        raise CorruptCheckpointError(
            f"{optim_files[0]}: 'param_alignment_paddings' is not a list of non-negative integers per group; "
            "the file is damaged"
        )
    if align_pads is not None and [len(p) for p in align_pads] != [len(g) for g in param_shapes]:
        raise CorruptCheckpointError(
            f"{optim_files[0]}: 'param_alignment_paddings' lists {[len(p) for p in align_pads]} params per "
            f"group, 'param_shapes' in {model_states.name} lists {[len(g) for g in param_shapes]}; the "
            "files come from different runs"
        )
    module = ms.get("module") if module_names_to_refs is None else None
    entries: dict[str, TensorEntry] = {}
    for g, shapes in enumerate(param_shapes):
        p_numel = parts.partition_numel[g]
        world = len(optim_files)
        starts = [r * p_numel for r in range(world)]
        # Moments keep the padding on every rank; masters only where keeps_padding.
        muon_at = muon_positions(shapes, p_numel, world, align_pads[g] if align_pads is not None else None) \
            if parts.muon[g] else {}
        offset = 0
        for i, (name, shape) in enumerate(shapes.items()):
            shape = tuple(int(s) for s in shape)
            numel = 1
            for s in shape:
                numel *= s
            spans = split_by_partitions(offset, numel, starts, [p_numel] * world)
            for sp in spans:
                if sp.src_offset + sp.numel > parts.stored_numels[g][sp.rank]:
                    raise CorruptCheckpointError(
                        f"{optim_files[sp.rank]}: param '{name}' needs elements up to "
                        f"{sp.src_offset + sp.numel} of fp32 group {g}, the rank stores "
                        f"{parts.stored_numels[g][sp.rank]}"
                    )
            master = Piece(Role.MASTER, "float32", tuple(
                Fragment(optim_files[sp.rank], (OSD, "single_partition_of_fp32_groups", g),
                         sp.src_offset, sp.numel, sp.dst_offset, sp.rank) for sp in spans))
            pieces = [master]
            mk = parts.moment_keys[g]
            if mk is not None:
                for sk in parts.state_keys[g]:
                    pieces.append(Piece(Role.OPTIM_STATE, parts.state_dtypes[g].get(sk, "float32"), tuple(
                        Fragment(optim_files[sp.rank], (*mk, sk), sp.src_offset, sp.numel,
                                 sp.dst_offset, sp.rank) for sp in spans), state_key=sk))
                if parts.muon[g] and spans:
                    pieces.append(muon_piece(muon_at, g, spans[0].rank, name, numel, optim_files, mk, cache))
            full_name = name_prefix + name
            if module_names_to_refs is not None and full_name in module_names_to_refs:
                path, key, ref = module_names_to_refs[full_name]
                pieces.append(Piece(Role.MODULE, ref.dtype_name, ((Fragment(path, key, 0, ref.numel, 0)),)))
            elif isinstance(module, Mapping) and isinstance(module.get(name), TensorRef):
                pieces.append(module_piece(model_states, name, module[name]))
            entries[full_name] = TensorEntry(full_name, shape, Kind.PARAM, True, tuple(pieces), group=g)
            offset += numel
            if align_pads is not None:
                offset += int(align_pads[g][i])
        if offset > p_numel * world:
            raise CorruptCheckpointError(
                f"{model_states}: group {g} params need {offset} elements, the fp32 partitions hold "
                f"{p_numel * world}; 'param_shapes' does not match the optimizer files"
            )
    return entries


def muon_positions(shapes: Mapping[str, Any], p_numel: int, world: int,
                   align: list[Any] | None) -> dict[tuple[int, str], int]:
    """Where each param of a Muon group lies in each rank's ``momentum_buffer``: ``{(rank, name): offset}`` for the
    ranks whose partition the param meets (the buffer is the concat of those params, whole, in flat order), and
    ``{(rank, ""): numel}`` each buffer's length."""
    out: dict[tuple[int, str], int] = {}
    offset = 0
    spans = []
    for i, (name, shape) in enumerate(shapes.items()):
        numel = math.prod(int(s) for s in shape)
        spans.append((name, offset, numel))
        offset += numel + (int(align[i]) if align is not None else 0)
    for r in range(world):
        lo, hi, pos = r * p_numel, (r + 1) * p_numel, 0
        for name, start, numel in spans:
            if start < hi and start + numel > lo and numel:
                out[(r, name)] = pos
                pos += numel
        out[(r, "")] = pos
    return out


def muon_piece(at: Mapping[tuple[int, str], int], g: int, rank: int, name: str, numel: int, optim_files: list[Path],
               mk: tuple[Any, ...], cache: FileCache) -> Piece:
    """The Muon ``momentum_buffer`` of param ``name`` of group ``g``: whole in the buffer of ``rank``, the first
    rank whose partition holds part of it (every such rank holds the same copy: DeepSpeed all-reduces the
    gradient of a split Muon param to each)."""
    path = optim_files[rank]
    ref = lookup(cache.tree(path), (*mk, MUON_STATE), path)
    if not isinstance(ref, TensorRef) or ref.numel != at[(rank, "")]:
        have = ref.numel if isinstance(ref, TensorRef) else 0
        raise CorruptCheckpointError(
            f"{path}: group {g}'s Muon {MUON_STATE} holds {have} elements, the whole params its partition meets "
            f"need {at[(rank, '')]}; the file is damaged or not a DeepSpeed 0.19.8 Muon save")
    return Piece(Role.OPTIM_STATE, ref.dtype_name,
                 (Fragment(path, (*mk, MUON_STATE), at[(rank, name)], numel, 0, rank),), state_key=MUON_STATE)


def flat_order_note(path: Path, g: int, shapes: Mapping[str, Any], module: Any,
                    align: list[Any] | None) -> str | None:
    """Cross-check the order ``param_shapes[g]`` gives (it decides which master elements belong to which
    name; under ``round_robin_gradients`` it is not module order) against a second record of it:
    DeepSpeed 0.19.8 saves the module's params as views into the group's flat buffer, so each view's
    ``storage_offset`` is its param's position in the flat group. Returns a note when they disagree.

    Not an error: DeepSpeed ignores these offsets on load, and a checkpoint resharded to another size
    under ``round_robin_gradients`` keeps its old module layout with the new order. For 16-bit runs the
    order is proven by value instead (``verify``: every master rounds to its name's 16-bit copy)."""
    if not isinstance(module, Mapping):
        return None
    found = [module.get(n) for n in shapes]
    refs = [r for r in found if isinstance(r, TensorRef)]
    if not refs or len(refs) != len(found):
        return None
    if len({(r.storage.path, r.storage.key) for r in refs}) != 1:
        return None  # separate tensors (older layouts): nothing to compare with
    offset = 0
    for i, (name, ref) in enumerate(zip(shapes, refs)):
        if ref.storage_offset != offset:
            return (f"{path.name}: param_shapes[{g}] puts '{name}' at element {offset} of its flat group, the "
                    f"saved module tensor views element {ref.storage_offset}: the flat order is not confirmed "
                    "by the module's layout")
        offset += ref.numel + (int(align[i]) if align is not None else 0)
    return None


def read_zero12(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    ms_path = files.mp_to_model_states[0]
    ms = cache.tree(ms_path)
    meta = metadata_from_model_states(ms)
    optim = files.dp_mp_to_optim_states
    world = meta.dp_world_size or files.optim_dp_world_size
    expect_dp_ranks(files, "optimizer-state", optim, world)
    if files.optim_dp_world_size != world:
        raise CorruptCheckpointError(
            f"'{files.tag_dir}': {files.optim_dp_world_size} optimizer files but dp_world_size={world} "
            f"in {ms_path.name}; remove the stray files or pick another tag"
        )
    optim_files = [optim[(d, 0)] for d in range(world)]
    osd0 = cache.tree(optim_files[0]).get(OSD)
    if not isinstance(osd0, Mapping) or "single_partition_of_fp32_groups" not in osd0:
        raise CorruptCheckpointError(f"{optim_files[0]}: no 'single_partition_of_fp32_groups'; not a ZeRO-1/2 file")
    zs = osd0.get("zero_stage")
    is_bf16_optimizer = zs is None
    stage = int(zs.value) if isinstance(zs, DeepSpeedEnum) else int(
        ((meta.ds_config or {}).get("zero_optimization") or {}).get("stage", 1))
    module = ms.get("module") or {}
    trainable = zero12_param_entries(model_states=ms_path, optim_files=optim_files, cache=cache,
                                     keeps_padding=is_bf16_optimizer)
    if module:
        # Every trainable param is also in the saved module state dict (DeepSpeed saves
        # module.state_dict(), frozen params or not): a name in 'param_shapes' without its module
        # tensor means one of the two name lists is damaged -- legacy files have no CRC to say so.
        for name, entry in trainable.items():
            if entry.piece(Role.MODULE) is None:
                raise CorruptCheckpointError(
                    f"{ms_path}: 'param_shapes' names '{name}' but the saved module has no tensor of that "
                    "name; the file is damaged or its parts come from different runs"
                )
    excluded_ties: list[tuple[str, str]] = []
    entries = module_side_entries(ms_path, ms, meta.buffer_names, trainable, excluded_ties)
    sample = next((r.dtype_name for r in module.values() if isinstance(r, TensorRef) and is_floating(r.dtype_name)),
                  None)
    wrapper = "BF16_Optimizer" if is_bf16_optimizer else "DeepSpeedZeroOptimizer"
    base = osd0.get("base_optimizer_state")
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir,
        # DeepSpeed 0.10.3 to 0.16.9 (files of 0.14.5 and 0.16.9) wrap stage-0 bf16 in BF16_Optimizer (bf16
        # grad_accum_dtype defaulted to fp32 without ZeRO), which writes the ZeRO-1 layout with
        # zero_optimization.stage 0 in its config; 0.18.9 and 0.19.8 use FP16_UnfusedOptimizer there.
        layout="zero1" if stage == 1 else "zero2" if stage == 2 else "stage0-bf16-optimizer",
        zero_stage=stage, precision=precision_of(meta.ds_config, sample),
        dp_world_size=world, pp_world_size=1, tp_world_size=1,
        ds_version=meta.ds_version, global_steps=meta.global_steps, global_samples=meta.global_samples,
        optimizer_step=step_of(base.get("state")) if isinstance(base, Mapping) else elastic_step(osd0),
        optimizer_wrapper=wrapper,
        entries=tuple(order_like_module(entries, list(module))),
        files=tuple(files.all_files()), ds_config=meta.ds_config,
        notes=tuple(n for g, shapes in enumerate(ms.get("param_shapes") or [])
                    if (n := flat_order_note(ms_path, g, shapes, module, _align(osd0, g))) is not None),
        excluded_ties=tuple(excluded_ties),
        optimizer_groups=zero12_optimizer_groups(base, ms.get("param_shapes"), meta.ds_config, world,
                                                 is_bf16_optimizer),
        optimizer_type=optimizer_type(meta.ds_config),
    )


def elastic_step(osd: Mapping[str, Any]) -> int | None:
    """The step of an ``elastic_checkpoint`` save (a list of per-group states): the first group state's ``step`` (the
    count the optimizer steps by), else ``base_optimizer_state_step``, the param groups' ``step``, which DeepSpeed
    0.19.8 writes only where the inner optimizer keeps one there (stage_1_and_2.py state_dict): torch's Adam/AdamW do
    not, and DeepSpeed's FusedAdam leaves it at 0 while it counts in each state."""
    base = osd.get("base_optimizer_state")
    step = step_of(dict(enumerate(base))) if isinstance(base, list) else None
    saved = osd.get("base_optimizer_state_step")
    return step if step is not None or saved is None else step_of({0: {"step": saved}})


def zero12_optimizer_groups(base: Any, param_shapes: Any, ds_config: Any, world: int,
                            bf16_optimizer: bool) -> tuple[OptimizerGroup, ...]:
    """The ZeRO-1/2 (or ``BF16_Optimizer``) inner optimizer's param groups: group ``g`` is flat group ``g``
    (``param_shapes[g]``, in flat order: round robin undone to give the optimizer's order) and keeps one state
    per group (``state`` keyed by the group's one flat param)."""
    if not isinstance(base, Mapping) or not isinstance(param_shapes, list):
        return ()
    z = (ds_config or {}).get("zero_optimization") if isinstance(ds_config, Mapping) else None
    round_robin = bool(z.get("round_robin_gradients", False)) if isinstance(z, Mapping) else False
    names = [[str(n) for n in shapes] for shapes in param_shapes]
    if round_robin and not bf16_optimizer:
        names = [undo_round_robin(n, world) for n in names]
    state = base.get("state") or {}
    groups = base.get("param_groups")
    states = []
    for g, pg in enumerate(groups if isinstance(groups, list) else []):
        params = pg.get("params") if isinstance(pg, Mapping) else None
        first = params[0] if isinstance(params, list) and params else g
        states.append(state.get(first) if isinstance(state, Mapping) else None)
    return optimizer_groups(groups, names, states)


def module_side_entries(ms_path: Path, ms: Mapping[str, Any], buffer_names: tuple[str, ...],
                        trainable: Mapping[str, TensorEntry],
                        excluded_ties: list[tuple[str, str]] | None = None) -> dict[str, TensorEntry]:
    """``trainable`` plus what a stage-1/2 model-states file holds besides them: frozen params (16-bit
    ``module`` copy, and at stage 2 ``frozen_param_fragments``), tied aliases (``shared_params``) and
    buffers. Also used for the copied model-states file of a universal checkpoint.

    ``excluded_ties``: when given, a tied alias whose source is not in the file is appended there instead of being
    an error, provided the file holds no frozen param at all (proof that the save excluded frozen params:
    ``exclude_frozen_parameters=True``, as the HF Trainer saves PEFT models); the alias keeps its own 16-bit
    ``module`` value, which DeepSpeed still saves (``module_state_dict`` drops only names that
    ``named_parameters()`` yields, and it yields a tied param once, under its source's name)."""
    module = ms.get("module") or {}
    entries = dict(trainable)
    shared = ms.get("shared_params") or {}
    buffers = set(buffer_names)
    frozen_shapes = ms.get("frozen_param_shapes") or {}
    frozen_frags = ms.get("frozen_param_fragments") or {}
    for name, ref in module.items():
        if name in entries or name in buffers or name in shared or not isinstance(ref, TensorRef):
            continue
        # Frozen: stage 2 also saves 'frozen_param_fragments' (full 16-bit); stage 1 only 'module'.
        pieces = [module_piece(ms_path, name, ref)]
        frag = frozen_frags.get(name)
        if isinstance(frag, TensorRef) and frag.numel == ref.numel:
            pieces.append(Piece(Role.MODULE, frag.dtype_name,
                                ((Fragment(ms_path, ("frozen_param_fragments", name), 0, frag.numel, 0)),),
                                replica=1))
        entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, False, tuple(pieces))
    _check_module_names(ms_path, module, entries, trainable, buffers, shared, ms.get("frozen_param_shapes"))
    for name in frozen_shapes:
        if name not in entries and name not in shared:
            raise CorruptCheckpointError(f"{ms_path}: frozen param '{name}' has no saved value")
    frozen_saved = any(e.kind is Kind.PARAM and not e.trainable for e in entries.values())
    for alias, source in shared.items():
        if source in entries:
            entries[alias] = alias_entry(alias, entries[source])
        elif excluded_ties is not None and not frozen_saved:
            excluded_ties.append((alias, source))
            ref = module.get(alias)
            if isinstance(ref, TensorRef) and ref.numel > 0:
                entries[alias] = TensorEntry(alias, ref.shape, Kind.PARAM, False, (module_piece(ms_path, alias, ref),))
        else:
            raise CorruptCheckpointError(f"{ms_path}: tied param '{alias}' points to unknown '{source}'")
    for e in buffer_entries(ms_path, module, buffer_names):
        entries[e.name] = e
    return entries


def _check_module_names(ms_path: Path, module: Mapping[str, Any], entries: Mapping[str, TensorEntry],
                        trainable: Mapping[str, TensorEntry], buffers: set[str], shared: Mapping[str, Any],
                        frozen_shapes: Any) -> None:
    """The module state dict's names against the other name lists of the same file (legacy files have
    no CRC, so a damaged name shows only here): a module tensor that is neither trainable, a buffer nor
    tied is a frozen param -- stage 2 lists those in 'frozen_param_shapes'; a buffer name the module
    lacks is legitimate only for a non-persistent buffer, never next to an unexplained module tensor."""
    strays = [n for n in entries if n not in trainable and n not in buffers and n not in shared]
    if isinstance(frozen_shapes, Mapping):
        unknown = [n for n in strays if n not in frozen_shapes]
        if unknown:
            raise CorruptCheckpointError(
                f"{ms_path}: module tensor '{unknown[0]}' is in neither 'param_shapes', 'frozen_param_shapes' "
                "nor 'buffer_names'; the file is damaged or its parts come from different runs")
    missing = [b for b in sorted(buffers) if not isinstance(module.get(b), TensorRef)]
    if missing and strays:
        raise CorruptCheckpointError(
            f"{ms_path}: buffer '{missing[0]}' is not in the saved module, which holds an unlisted tensor "
            f"'{strays[0]}'; the file is damaged or its parts come from different runs")


def _align(osd: Mapping[str, Any], g: int) -> list[Any] | None:
    pads = osd.get("param_alignment_paddings")
    return pads[g] if isinstance(pads, list) and g < len(pads) else None
