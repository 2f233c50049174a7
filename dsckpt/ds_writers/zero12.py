"""ZeRO-1/2 and ``BF16_Optimizer`` writer: one flat fp32 partition per param group and rank
(the mirror of :mod:`dsckpt.readers.zero12`).

Layout (DeepSpeed 0.19.8, stage_1_and_2.py:387-508, 3358-3403; bf16_optimizer.py:165-222, 629-643):
per group, the trainable params in flat order (round-robin order under ``round_robin_gradients``),
each followed by its ``parameter_alignment`` padding, the group zero-padded to a multiple of
``2 * world_size`` and cut into ``world_size`` equal partitions. ZeRO strips a rank's tail padding
from ``single_partition_of_fp32_groups``; ``BF16_Optimizer`` keeps it (and has no alignment
padding, round robin, ``zero_stage`` or ``loss_scaler``). The Adam moments are always the full
padded partition.

One ``mp_rank_00_model_states.pt`` holds the whole module (16-bit params, buffers); from a ZeRO-3
source it is rebuilt: buffers from source rank 0, frozen params from their partitions, trainable
params from the fp32 master (cast to the 16-bit dtype: DeepSpeed overwrites them from the master on
load, stage_1_and_2.py:3774-3787).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

from ..errors import CorruptCheckpointError
from ..model import Kind, LogicalCheckpoint, Precision, Role
from ..partition import (
    bf16_optimizer_group_padding,
    param_alignment_paddings,
    round_robin_order,
    zero12_group_layout,
    zero12_param_slice_mappings,
)
from ..readers.zero12 import MUON_STATE
from .common import (
    OSD,
    OptimizerScalars,
    fragment_address,
    group_state_tree,
    group_states,
    shapes_tree,
    streamed,
    target_ds_config,
    zero_stage_enum,
)
from .experts import expert_files_and_note, expert_groups
from .plan import (
    BF16_WRAPPER,
    FlatSpec,
    GroupPartition,
    LayoutPlan,
    ModuleSource,
    OptimizerCopies,
    RankPlan,
    coalesce,
    element_nbytes,
    optim_file_name,
    range_copies,
)

__all__ = ["plan_zero12", "zero12_model_tree", "zero12_optim_tree"]


def plan_zero12(ckpt: LogicalCheckpoint, world: int, group_orders: Sequence[Sequence[str]], *,
                round_robin: bool, parameter_alignment: bool, bf16_optimizer: bool,
                common: Mapping[str, Any]) -> LayoutPlan:
    """Plan ZeRO-1/2 (or ``BF16_Optimizer``) files for ``world`` ranks.

    ``group_orders``: per optimizer param group, its trainable params in the optimizer's own order
    (before any round robin). ``common``: the :class:`LayoutPlan` fields that do not depend on the
    layout.
    """
    by_name = {e.name: e for e in ckpt.entries}
    change = common.get("precision_change")  # the written 16-bit dtype sets the alignment (ds_writers.precision)
    elem = element_nbytes(change.precision if change is not None else ckpt.precision)
    # A group's entries and a rank's position in it: the logical entries over all ranks, or (experts) the entries
    # of the rank's expert-parallel rank over its expert-data-parallel group.
    experts = expert_groups(ckpt, world, group_orders, common["parallel"])
    entries_of = experts.position
    param_shapes = []
    all_paddings = []
    group_layouts = []  # per group: (names in flat order, layout, names in bit16 order, paddings)
    for g, original_names in enumerate(group_orders):
        original = list(original_names)
        n = len(original)
        flat = [original[i] for i in round_robin_order(n, world)] if round_robin and not bf16_optimizer else original
        for name in flat:
            if name not in by_name:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{name}' of group {g} has no stored values")
        entry0 = entries_of(g, 0)[1]  # every rank of a group holds the same shapes
        numels = [entry0(nm).numel for nm in flat]
        pads = param_alignment_paddings(numels, elem, enabled=parameter_alignment and not bf16_optimizer)
        # An expert group is partitioned over the expert-data-parallel group only (its alignment too:
        # stage_1_and_2.py uses the size of real_dp_process_group[g]).
        layout = zero12_group_layout(numels, experts.partition_count(g, world), alignment_paddings=pads)
        param_shapes.append(tuple((nm, entry0(nm).shape) for nm in flat))
        all_paddings.append(tuple(pads))
        group_layouts.append((flat, layout, original, pads))

    ranks = []
    for r in range(world):
        groups = []
        for g, (flat, layout, original, pads) in enumerate(group_layouts):
            k, entry_of = entries_of(g, r)
            p_numel = layout.partition_numel
            p_start = k * p_numel
            padding = (bf16_optimizer_group_padding(layout, k) if bf16_optimizer else layout.rank_padding(k))
            stored = p_numel if bf16_optimizer else p_numel - layout.rank_padding(k)
            muon = g < len(ckpt.optimizer_groups) and bool(ckpt.optimizer_groups[g].hyperparam("use_muon"))
            copies = OptimizerCopies(ckpt, (entry_of(nm) for nm in flat), whole=(MUON_STATE,) if muon else ())
            for nm, off, numel in zip(flat, layout.param_offsets, layout.param_numels):
                lo, hi = max(off, p_start), min(off + numel, p_start + p_numel)
                if lo >= hi:
                    continue
                copies.add(nm, entry_of(nm), lo - off, hi - lo, lo - p_start)
            offsets_by_name = dict(zip(flat, layout.param_offsets))
            orig_numels = [entry_of(nm).numel for nm in original]
            maps = zero12_param_slice_mappings(
                orig_numels, p_start, p_numel,
                [offsets_by_name[nm] for nm in original] if any(pads) else None)
            groups.append(GroupPartition(
                group=g, partition_numel=p_numel, padding_numel=padding,
                master=copies.master_spec(stored), states=copies.state_specs(p_numel),
                slice_mappings=tuple((original[m.index], m.start, m.numel) for m in maps),
                partition_count=layout.world_size if experts.ep(g) else None,
            ))
        ranks.append(RankPlan(r, optim_file_name(r, common["bf16_prefixed_optim"], common.get("mp_rank", 0)), None,
                              tuple(groups)))
    notes = list(common.get("notes", ()))
    if round_robin and not bf16_optimizer:
        notes.append("round_robin_gradients: flat order recomputed for the new size; param_slice_mappings "
                     "reproduce DeepSpeed 0.19.8's own (mis-ordered) mapping")
    copied, expert_notes = expert_files_and_note(ckpt, world, common["parallel"],
                                                 tuple(common.get("copied_model_files", ())))
    notes += expert_notes
    return LayoutPlan(**{**common, "notes": tuple(notes), "copied_model_files": copied},
                      param_shapes=tuple(param_shapes),
                      subgroup_to_group=tuple(range(len(param_shapes))), alignment_paddings=tuple(all_paddings),
                      ranks=tuple(ranks))


# --------------------------------------------------------------------------------------------
# Trees (read the source trees through ``cache``; tensor bytes stay in the files)


def zero12_model_tree(plan: LayoutPlan, ckpt: LogicalCheckpoint, cache: Any) -> tuple[str, dict[str, Any]]:
    """The target's ``mp_rank_{mp_rank:02d}_model_states.pt``: its name and tree."""
    name = f"mp_rank_{plan.mp_rank:02d}_model_states.pt"
    if plan.module_source is ModuleSource.FLAT_16BIT:
        assert len(plan.source_model_files) == 1
        tree = dict(cache.tree(plan.source_model_files[0]))
        tree["dp_world_size"] = plan.world_size
        tree["param_shapes"] = shapes_tree(plan, tree.get("param_shapes"))
        if plan.tp_size != plan.source_tp_size and tree.get("module") is not None:
            # another TP cut: the module's 16-bit slices are re-cut too (a pipeline's are in its layer files)
            tree["module"] = module_from_copies(ckpt, tree["module"], cache)
            _set_frozen(tree, plan, ckpt, tree["module"])
        if plan.changes_layout:  # another stage, or wrapper (a stage-0 BF16_Optimizer save's config says stage 0)
            _set_frozen(tree, plan, ckpt, dict(tree.get("module") or {}))  # a pipeline's: None (layer files)
            tree["ds_config"] = target_ds_config(tree.get("ds_config"), plan.zero_stage, None)
        if _stage0_pipeline(plan, tree):
            # its optimizer state is kept here too; in the ZeRO-1 layout it is in the optimizer files only
            tree["optimizer"] = None
            tree["ds_config"] = target_ds_config(tree.get("ds_config"), plan.zero_stage, None)
        return name, tree
    if plan.module_source is ModuleSource.FULL_MODULE:  # already there (16-bit, or fp32 = the master)
        from .common import zero_keys_from_stage0

        tree = dict(cache.tree(plan.source_model_files[0]))
        zero_keys_from_stage0(tree, ckpt)
        if plan.tp_size != plan.source_tp_size:  # another TP cut: the module's slices are re-cut too
            tree["module"] = module_from_copies(ckpt, tree["module"], cache)
        tree["dp_world_size"] = plan.world_size
        tree["param_shapes"] = shapes_tree(plan)
        _set_frozen(tree, plan, ckpt, dict(tree["module"] or {}))  # a pipeline's module is None (in layer files)
        tree["ds_config"] = target_ds_config(tree.get("ds_config"), plan.zero_stage, None)
        return name, tree
    assert plan.module_source is ModuleSource.MASTERS_CAST
    src = dict(cache.tree(plan.source_model_files[0]))  # source rank 0: its buffers and shared_params
    module = full_module(ckpt, src["module"], cache)
    tree = dict(src)
    tree["module"] = module
    tree["param_shapes"] = shapes_tree(plan)
    _set_frozen(tree, plan, ckpt, module)
    tree["dp_world_size"] = plan.world_size
    tree["ds_config"] = target_ds_config(tree.get("ds_config"), plan.zero_stage, None)
    return name, tree


def _stage0_pipeline(plan: LayoutPlan, tree: Mapping[str, Any]) -> bool:
    """Whether ``tree`` is a file of a bf16 pipeline run without ZeRO (BF16_Optimizer; its ds_config says stage 0),
    which is written as ZeRO-1 BF16_Optimizer files (``ds_writers.STAGE0_BF16_PIPELINE_NOTE``)."""
    z = (tree.get("ds_config") or {}).get("zero_optimization") if isinstance(tree.get("ds_config"), Mapping) else None
    stage = z.get("stage", 0) if isinstance(z, Mapping) else 0
    pipeline = plan.pp_size > 1 or plan.source_pp_size > 1 or tree.get("module", {}) is None  # a 1-stage one too
    return pipeline and stage != plan.zero_stage


def _set_frozen(tree: dict[str, Any], plan: LayoutPlan, ckpt: LogicalCheckpoint, module: Mapping[str, Any]) -> None:
    """``frozen_param_shapes`` / ``frozen_param_fragments``: saved (full, 16-bit) at stage 2 only
    (engine.py:5383, 5301)."""
    from ..writers.torch_stream import Size

    frozen = [e for e in ckpt.entries if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None]
    if plan.zero_stage == 2:
        tree["frozen_param_shapes"] = OrderedDict((e.name, Size(e.shape)) for e in frozen)
        tree["frozen_param_fragments"] = OrderedDict((e.name, module[e.name]) for e in frozen)
    else:
        tree["frozen_param_shapes"] = None
        tree["frozen_param_fragments"] = None


def full_module(ckpt: LogicalCheckpoint, src_module: Mapping[str, Any], cache: Any) -> OrderedDict[str, Any]:
    """The full module state dict from a ZeRO-3 source, in the source's key order: buffers as stored
    on rank 0, frozen params from their 16-bit partitions, trainable params from the fp32 master
    (cast to the module dtype; only that needs torch), tied aliases sharing their source's tensor."""
    by_name = {e.name: e for e in ckpt.entries}
    out: OrderedDict[str, Any] = OrderedDict()
    pending_aliases = []
    for key, ref in src_module.items():
        e = by_name.get(key)
        if e is None or e.kind is Kind.BUFFER:
            out[key] = ref
        elif e.tied_to is not None:
            pending_aliases.append((key, e.tied_to))
            out[key] = None
        elif not e.trainable:
            piece = e.piece(Role.MODULE)
            assert piece is not None, f"frozen param {key} has no stored values"
            out[key] = streamed(FlatSpec(e.numel, piece.dtype, coalesce(range_copies(piece, 0, e.numel, 0, key))),
                                cache, shape=e.shape)
        else:
            out[key] = _bit16_from_master(e, ckpt.precision, ref, cache)
    for alias, source in pending_aliases:
        out[alias] = out[source]
    return out


def module_from_copies(ckpt: LogicalCheckpoint, src_module: Mapping[str, Any], cache: Any) -> OrderedDict[str, Any]:
    """The module state dict of ``ckpt`` (a TP rank's view, :func:`dsckpt.tensor_parallel.rank_view`) in the source's
    key order: every param streamed from its module copy's fragments at the view's shape, buffers as stored, tied
    aliases sharing their source's tensor."""
    by_name = {e.name: e for e in ckpt.entries}
    out: OrderedDict[str, Any] = OrderedDict()
    for key, ref in src_module.items():
        e = by_name.get(key)
        if e is None or e.kind is Kind.BUFFER:
            out[key] = ref
        elif e.tied_to is not None:
            out[key] = out[e.tied_to] if e.tied_to in out else None
        else:
            piece = e.piece(Role.MODULE)
            if piece is None:
                raise CorruptCheckpointError(f"param '{key}' has no module copy")
            out[key] = streamed(FlatSpec(e.numel, piece.dtype, coalesce(range_copies(piece, 0, e.numel, 0, key))),
                                cache, shape=e.shape)
    for key, v in list(out.items()):
        e = by_name.get(key)
        if v is None and e is not None and e.tied_to is not None:
            out[key] = out[e.tied_to]
    return out


def _bit16_from_master(e: Any, precision: Precision, placeholder: Any, cache: Any) -> Any:
    from ..writers.torch_stream import dtype_name

    master = e.piece(Role.MASTER)
    if master is None:
        raise CorruptCheckpointError(f"param '{e.name}' has no fp32 master values")
    spec = FlatSpec(e.numel, "float32", coalesce(range_copies(master, 0, e.numel, 0, e.name)))
    target_dtype = dtype_name(placeholder)
    if precision is Precision.FP32 or target_dtype == "float32":
        return streamed(spec, cache, shape=e.shape)
    import torch

    from ..assemble import read_piece

    return read_piece(master, e.shape, cache, name=e.name).to(getattr(torch, target_dtype))


def zero12_optim_tree(plan: LayoutPlan, r: RankPlan, src0: Mapping[str, Any], scalars: OptimizerScalars | None,
                      cache: Any) -> dict[str, Any]:
    """Rank ``r``'s optimizer file. ``src0``: source rank 0's optimizer tree when the source has this
    layout (every key kept, the partitions replaced); otherwise ``scalars`` from the source."""
    if scalars is not None:
        src0 = _template(plan, scalars)
    osd0 = src0[OSD]
    base0 = osd0["base_optimizer_state"]
    osd = dict(osd0)
    if isinstance(base0, list):  # elastic_checkpoint (facts.is_elastic): per group, its lean state
        osd["base_optimizer_state"] = [group_state_tree(base0[g.group], _lean(g), cache) for g in r.groups]
        if "base_optimizer_state_step" not in osd0:
            osd = _with_elastic_step(osd, base0)
    else:
        states = group_states(base0)
        state: dict[Any, Any] = {}
        for g, pg in zip(r.groups, base0["param_groups"]):
            state[pg["params"][0]] = group_state_tree(states[g.group], g.state_specs, cache)
        osd["base_optimizer_state"] = {**base0, "state": state}
    osd["single_partition_of_fp32_groups"] = [streamed(g.master, cache) for g in r.groups]
    osd["group_paddings"] = [g.padding_numel for g in r.groups]
    osd["partition_count"] = [g.partition_count or plan.world_size for g in r.groups]
    # param_alignment_paddings is absent from the files of DeepSpeed 0.10.3-0.18.9 (seen in 0.10.3, 0.12.6, 0.14.5,
    # 0.16.9, 0.18.9), whose loaders never look for it: write it only where the source has it.
    if "param_alignment_paddings" in osd0:
        osd["param_alignment_paddings"] = [list(p) for p in plan.alignment_paddings]
    osd["param_slice_mappings"] = [OrderedDict((n, fragment_address(numel, start))
                                               for n, start, numel in g.slice_mappings) for g in r.groups]
    if scalars is None and plan.from_stage != plan.zero_stage:  # ZeRO-1 <-> ZeRO-2: same files but the stage
        osd["zero_stage"] = zero_stage_enum(plan.zero_stage)
        return {**src0, OSD: osd, "ds_config": target_ds_config(src0.get("ds_config"), plan.zero_stage, None)}
    if _stage0_pipeline(plan, src0):
        return {**src0, OSD: osd, "ds_config": target_ds_config(src0.get("ds_config"), plan.zero_stage, None)}
    return {**src0, OSD: osd}


def _with_elastic_step(osd: Mapping[str, Any], base: list[Any]) -> dict[str, Any]:
    """``osd`` with ``base_optimizer_state_step`` (right after ``base_optimizer_state``, where DeepSpeed puts it): the
    groups' common ``step``. DeepSpeed 0.19.8 saves that key only where the inner optimizer keeps ``step`` in its param
    groups, which torch's Adam/AdamW do not, yet its elastic load asserts it (stage_1_and_2.py
    _restore_step_from_elastic_checkpoint): without it no engine loads the files, not even DeepSpeed's own save at its
    own size. The value is exact (each group state's saved ``step``); the load writes it into the param groups, where
    torch's Adam does not read it. Unchanged when the groups disagree or keep no step."""
    from ..readers.common import saved_step

    steps = {saved_step(st.get("step")) if isinstance(st, Mapping) else None for st in base}
    step = steps.pop() if len(steps) == 1 else None
    if step is None:
        return dict(osd)
    if isinstance(step, float) and step.is_integer():
        step = int(step)
    out: dict[str, Any] = {}
    for k, v in osd.items():
        out[k] = v
        if k == "base_optimizer_state":
            out["base_optimizer_state_step"] = step
    return out


def _lean(g: GroupPartition) -> dict[str, FlatSpec]:
    """Group ``g``'s per-element optimizer states as an ``elastic_checkpoint`` save keeps them: cut to the stored fp32
    partition, the rank's tail padding stripped (stage_1_and_2.py _get_state_without_padding)."""
    stored = g.master.numel
    out = {}
    for key, spec in g.state_specs.items():
        assert all(c.dst_offset + c.numel <= stored for c in spec.copies), "state values in the tail padding"
        out[key] = FlatSpec(stored, spec.dtype, spec.copies)
    return out


def _template(plan: LayoutPlan, s: OptimizerScalars) -> dict[str, Any]:
    """A rank-0 optimizer tree of this layout, in DeepSpeed's key order, holding the source's
    scalars (stage_1_and_2.py:3358-3403; bf16_optimizer.py:629-643)."""
    n_groups = len(plan.param_shapes)
    if len(s.param_groups) != n_groups:
        raise CorruptCheckpointError(f"the source optimizer has {len(s.param_groups)} param groups, its params "
                                     f"{n_groups}")
    base = {"state": {g: dict(s.group_states[g]) if g < len(s.group_states) else {} for g in range(n_groups)},
            "param_groups": [{**pg, "params": [g]} for g, pg in enumerate(s.param_groups)]}
    osd: dict[str, Any]
    if plan.optimizer_wrapper == BF16_WRAPPER:
        osd = {"clip_grad": s.clip_grad if s.clip_grad is not None else 0.0, "base_optimizer_state": base,
               "single_partition_of_fp32_groups": None, "group_paddings": None, "partition_count": None,
               "ds_version": s.ds_version, "param_slice_mappings": None}
    else:
        osd = {"loss_scaler": s.loss_scaler, "dynamic_loss_scale": s.dynamic_loss_scale, "overflow": s.overflow}
        if s.clip_grad is not None:
            osd["clip_grad"] = s.clip_grad
        osd.update({"base_optimizer_state": base, "single_partition_of_fp32_groups": None,
                    "zero_stage": zero_stage_enum(plan.zero_stage), "group_paddings": None,
                    "param_alignment_paddings": None, "partition_count": None, "ds_version": s.ds_version,
                    "param_slice_mappings": None})
    top = dict(s.top)
    top["ds_config"] = target_ds_config(top.get("ds_config"), plan.zero_stage, None)
    return {OSD: osd, **top}
