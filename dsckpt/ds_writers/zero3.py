"""ZeRO-3 writer: every param cut on its own over the ranks; one model-states and one optimizer
file per rank (the mirror of :mod:`dsckpt.readers.zero3`).

Layout (DeepSpeed 0.19.8, partition_parameters.py:1690-1696, stage3.py:1210-1233, 3431-3447): a
param's rank-``r`` piece is elements ``[r*p, (r+1)*p)`` of it, ``p = ceil(numel / ws)``, zero padded
on the last rank(s); a rank's fp32 sub-group is the concatenation of its pieces of that sub-group's
params. Sub-groups are formed per optimizer param group from consecutive params until their
*partition* sizes reach ``sub_group_size``, so they change with the world size. Model-states files
hold 0-element placeholders for params, full buffers, and each rank's 16-bit pieces of the frozen
params (``frozen_param_fragments``); ``shared_params`` is filled on rank 0 only (engine.py:5490-5528).
"""

from __future__ import annotations

import functools
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from .. import nvme_swap
from ..errors import CorruptCheckpointError
from ..model import Kind, LogicalCheckpoint, Role
from ..partition import zero3_partition_numel, zero3_sub_groups
from .common import (
    OSD,
    OptimizerScalars,
    group_state_tree,
    group_states,
    shapes_tree,
    streamed,
    target_ds_config,
    zero_stage_enum,
)
from .experts import expert_groups
from .plan import (
    FlatSpec,
    GroupPartition,
    LayoutPlan,
    ModuleSource,
    OptimizerCopies,
    RankPlan,
    model_file_name,
    optim_file_name,
    range_copies,
)

__all__ = ["plan_zero3", "zero3_model_tree", "zero3_optim_tree", "zero3_swap_jobs"]


def plan_zero3(ckpt: LogicalCheckpoint, world: int, group_orders: Sequence[Sequence[str]], *,
               sub_group_size: int | None, param_ds_ids: Mapping[str, int], source_subgroups: int,
               common: Mapping[str, Any]) -> LayoutPlan:
    """Plan ZeRO-3 files for ``world`` ranks. ``group_orders``: per optimizer param group, its
    trainable params in order; ``source_subgroups``: how many (sub-)groups the source has (for a note)."""
    by_name = {e.name: e for e in ckpt.entries}
    # A group's entries and a rank's partition index in it (AutoEP experts: the rank's expert-parallel rank's local
    # view, partitioned over its expert-data-parallel group; see ds_writers/experts.py), and its partition count.
    experts = expert_groups(ckpt, world, group_orders, common["parallel"])

    def entries_of(g: int, rank: int) -> tuple[int, Callable[[str], Any], int]:
        return (*experts.position(g, rank), experts.partition_count(g, world))

    target_subgroups: list[list[str]] = []
    sub_to_group: list[int] = []
    for g, group_names in enumerate(group_orders):
        for name in group_names:
            if name not in by_name:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{name}' of group {g} has no stored values")
        _, ents0, count = entries_of(g, 0)
        for idx in zero3_sub_groups([ents0(n).numel for n in group_names], count, sub_group_size):
            target_subgroups.append([group_names[i] for i in idx])
            sub_to_group.append(g)
    # NVMe optimizer offload: a sub-group whose per-rank partition DeepSpeed swaps lives in swap files
    nvme = ckpt.ds_config if nvme_swap.nvme_optimizer(ckpt.ds_config) else None
    ranks = []
    for r in range(world):
        groups = []
        for t, names in enumerate(target_subgroups):
            offset = 0
            k, ents, count = entries_of(sub_to_group[t], r)
            copies = OptimizerCopies(ckpt, (ents(nm) for nm in names))
            for nm in names:
                e = ents(nm)
                per = zero3_partition_numel(e.numel, count)
                lo, hi = k * per, min((k + 1) * per, e.numel)
                if lo < hi:
                    copies.add(nm, e, lo, hi - lo, offset)
                offset += per
            ds_id = (f"{param_ds_ids[names[0]]}_{param_ds_ids[names[-1]]}"
                     if names and names[0] in param_ds_ids and names[-1] in param_ds_ids else None)
            groups.append(GroupPartition(
                group=t, partition_numel=offset, padding_numel=0,
                master=copies.master_spec(offset), states=copies.state_specs(offset),
                ds_id=ds_id,
                swapped=nvme is not None and ds_id is not None and nvme_swap.swappable(offset, nvme),
            ))
        frozen = []
        for e in ckpt.entries:
            if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None:
                per = zero3_partition_numel(e.numel, world)
                lo, hi = r * per, min((r + 1) * per, e.numel)
                piece = e.piece(Role.MODULE)
                dtype = piece.dtype if piece else "float32"
                frozen.append((e.name, FlatSpec(per, dtype, range_copies(piece, lo, max(0, hi - lo), 0, e.name))))
        mp = common.get("mp_rank", 0)
        ranks.append(RankPlan(r, optim_file_name(r, common["bf16_prefixed_optim"], mp), model_file_name(r, mp),
                              tuple(groups), tuple(frozen)))
    shapes = tuple(tuple((n, entries_of(sub_to_group[t], 0)[1](n).shape) for n in names)
                   for t, names in enumerate(target_subgroups))
    notes = list(common.get("notes", ()))
    if nvme is not None:
        swapped = sum(g.swapped for g in ranks[0].groups)
        notes.append(f"NVMe optimizer offload: {swapped} of {len(target_subgroups)} sub-groups per rank are swapped "
                     f"at {world} ranks (>= 1 MiB of fp32 each); their masters and optimizer state go to "
                     f"{nvme_swap.OFFLOAD_DIR}/rankNN/, the rest into the optimizer files")
    if len(target_subgroups) != source_subgroups:
        notes.append(f"ZeRO-3 sub-groups re-formed for {world} ranks: {source_subgroups} -> "
                     f"{len(target_subgroups)} (sub_group_size counts per-rank partition sizes)")
    return LayoutPlan(**{**common, "notes": tuple(notes)}, param_shapes=shapes,
                      subgroup_to_group=tuple(sub_to_group), alignment_paddings=(), ranks=tuple(ranks),
                      sub_group_size=sub_group_size)


# --------------------------------------------------------------------------------------------
# Trees


def zero3_model_tree(plan: LayoutPlan, r: RankPlan, ckpt: LogicalCheckpoint, src_models: Sequence[Mapping[str, Any]],
                     cache: Any) -> dict[str, Any]:
    """Rank ``r``'s model-states tree. ``src_models``: the source's model-states trees (one per
    source rank at stage 3; the one ``mp_rank_00`` file at stage 1/2)."""
    # Stage-3 ranks keep their own buffers (BatchNorm statistics are not synchronised): a rank that
    # existed before keeps its file's, a new rank starts from rank 0's.
    source_rank = r.rank if r.rank < len(src_models) else 0
    tree = dict(src_models[source_rank])
    if r.rank > 0 and source_rank == 0:
        tree["shared_params"] = {}  # DeepSpeed computes shared_params on rank 0 only (engine.py:5490-5528)
    if plan.module_source is ModuleSource.FULL_MODULE:
        from .common import zero_keys_from_stage0

        zero_keys_from_stage0(tree, ckpt, r.rank)
    if plan.module_source is not ModuleSource.MASTERS_CAST:
        _partitioned_module(tree, ckpt)
    # every written file records the target's sub_group_size, as the optimizer files do (_template, zero3_optim_tree)
    tree["ds_config"] = target_ds_config(tree.get("ds_config"), 3, plan.sub_group_size)
    tree["dp_world_size"] = plan.world_size
    tree["param_shapes"] = shapes_tree(plan)
    if tree.get("frozen_param_fragments") is not None or r.frozen_fragments:
        tree["frozen_param_fragments"] = OrderedDict((n, streamed(spec, cache)) for n, spec in r.frozen_fragments)
    return tree


def _partitioned_module(tree: dict[str, Any], ckpt: LogicalCheckpoint) -> None:
    """A ZeRO-1/2 model-states tree made ZeRO-3's: params become 0-element placeholders of their dtype
    (buffers stay), ``frozen_param_shapes`` is listed (engine.py:5427-5446)."""
    from ..writers.torch_stream import Size, StreamedTensor, dtype_name

    by_name = {e.name: e for e in ckpt.entries}
    module: OrderedDict[str, Any] = OrderedDict()
    for key, ref in tree["module"].items():
        e = by_name.get(key)
        if e is not None and e.kind is Kind.PARAM:
            module[key] = StreamedTensor(dtype_name(ref), (0,), ())
        else:
            module[key] = ref
    tree["module"] = module
    frozen = [e for e in ckpt.entries if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None]
    tree["frozen_param_shapes"] = OrderedDict((e.name, Size(e.shape)) for e in frozen)
    tree["frozen_param_fragments"] = OrderedDict()


def zero3_optim_tree(plan: LayoutPlan, r: RankPlan, src0: Mapping[str, Any], scalars: OptimizerScalars | None,
                     cache: Any) -> dict[str, Any]:
    """Rank ``r``'s optimizer tree. ``src0``: source rank 0's optimizer tree when the source is ZeRO-3
    (every key kept, the partitions replaced); otherwise ``scalars`` from the source."""
    if scalars is not None:
        src0 = _template(plan, scalars)
    osd0 = src0[OSD]
    inner0 = osd0[OSD]
    # each sub-group's state starts from its param group's (step and scalars as saved; each group its own)
    states = scalars.group_states if scalars is not None else group_states(inner0)
    state: dict[Any, Any] = {}
    for g in r.groups:
        owner = plan.subgroup_to_group[g.group]
        state[g.group] = group_state_tree(states[owner] if owner < len(states) else {}, g.state_specs, cache,
                                          functools.partial(_saved, g, cache=cache))
    param_groups = []
    for gi, pg in enumerate(inner0["param_groups"]):
        param_groups.append({**pg, "params": [t for t, owner in enumerate(plan.subgroup_to_group) if owner == gi]})
    osd = dict(osd0)
    osd["partition_count"] = plan.world_size
    osd[OSD] = {**inner0, "state": state, "param_groups": param_groups}
    osd["fp32_flat_groups"] = [_saved(g, g.master, cache, {"ds_id": g.ds_id} if g.ds_id is not None else None)
                               for g in r.groups]
    out = {**src0, OSD: osd}
    if "ds_config" in out:  # the target's sub_group_size, as the model-states files record it (zero3_model_tree)
        out["ds_config"] = target_ds_config(out["ds_config"], 3, plan.sub_group_size)
    return out


def _saved(g: GroupPartition, spec: FlatSpec, cache: Any, attrs: dict[str, Any] | None = None) -> Any:
    """What the optimizer file holds of one flat tensor: the tensor, or for a sub-group swapped to NVMe the
    empty tensor DeepSpeed saves there (its data is in the swap files, :func:`zero3_swap_jobs`)."""
    return streamed(FlatSpec(0, spec.dtype, ()) if g.swapped else spec, cache, attrs)


def zero3_swap_jobs(plan: LayoutPlan, r: RankPlan, ds_config: Mapping[str, Any] | None,
                    cache: Any) -> list[tuple[str, Any]]:
    """``(path relative to the tag folder, raw tensor)`` of rank ``r``'s NVMe swap files: the master and each
    optimizer state tensor of every swapped sub-group, padded to DeepSpeed's I/O alignment with zeros."""
    folder = f"{nvme_swap.OFFLOAD_DIR}/{nvme_swap.rank_dir(r.rank)}"
    jobs: list[tuple[str, Any]] = []
    for g in r.groups:
        if not g.swapped:
            continue
        assert g.ds_id is not None
        for name, spec in ((nvme_swap.master_file(g.ds_id), g.master),
                           *((nvme_swap.state_file(k, g.ds_id), st) for k, st in g.states)):
            padded = FlatSpec(nvme_swap.aligned_numel(spec.numel, ds_config), spec.dtype, spec.copies)
            jobs.append((f"{folder}/{name}", streamed(padded, cache)))
    return jobs


def _template(plan: LayoutPlan, s: OptimizerScalars) -> dict[str, Any]:
    """A rank-0 ZeRO-3 optimizer tree in DeepSpeed's key order holding the source's scalars
    (stage3.py:3431-3447). ZeRO-3 stores no ``clip_grad``: the new engine keeps its configured one."""
    osd = {"zero_stage": zero_stage_enum(3), "loss_scaler": s.loss_scaler,
           "dynamic_loss_scale": s.dynamic_loss_scale, "overflow": s.overflow, "partition_count": None,
           OSD: {"state": {}, "param_groups": [dict(pg) for pg in s.param_groups]},
           "fp32_flat_groups": None}
    top = dict(s.top)
    top["ds_config"] = target_ds_config(top.get("ds_config"), 3, plan.sub_group_size)
    return {OSD: osd, **top}
