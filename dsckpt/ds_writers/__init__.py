"""DeepSpeed layout writers: the mirror of :mod:`dsckpt.readers`.

Design (drawn in ``docs/design.md``, which names the module for each layout and each dimension)
------
A reshard is planned in three phases, each once, data flowing one way:

1. **describe the source** (:mod:`.source`): :func:`.source.describe_source` turns the logical checkpoint and the
   facts of its rank-0 files (:func:`.facts.read_source_facts`) into one frozen :class:`.source.SourceDescription`
   and refuses what no target can be written from;
2. **resolve the target** (:mod:`.target`): :func:`.target.resolve_target` checks every flag against that
   description in one table (:data:`.target.RULES`: flag, when it refuses, message, exit code) and decides the
   :class:`~.plan.Target`: ZeRO stage, optimizer wrapper, data-parallel size, the
   :class:`~dsckpt.parallel_layout.ParallelTarget` (TP cut, pipeline stages, expert cut), sub-groups, stage-0 writer;
3. **plan the files** (:func:`plan_layout`): pure functions of (source, target) -- per model-parallel rank
   (:func:`.retarget.rank_view`) the writer of the target's layout, one module per layout, named like its reader:

=====================  ==============================================  ==========================
module                 layout                                          reader
=====================  ==============================================  ==========================
:mod:`.stage0`         no ZeRO: ``mp_rank_00_model_states.pt`` only     ``readers/stage0.py``
:mod:`.zero12`         ZeRO-1/2 and ``BF16_Optimizer`` flat partitions  ``readers/zero12.py``
:mod:`.zero3`          ZeRO-3 per-param partitions, sub-groups          ``readers/zero3.py``
:mod:`.universal`      universal folder: ``zero/<param>/<state>.pt``    ``readers/universal.py``
=====================  ==============================================  ==========================

and one module per dimension the writers compose: :mod:`.experts` (which ranks hold which experts: native MoE
:mod:`.moe`, AutoEP :mod:`.autoep`), :mod:`.retarget` (the TP and stage cuts of a model-parallel rank, and every
tree's parallel sizes rewritten), :mod:`.precision` (``--dtype``: decided in phase 2, every tree rewritten for it by
:func:`.precision.retype_tree`), :mod:`dsckpt.nvme_swap` (ZeRO-3 NVMe swap files). A
:class:`~.plan.LayoutPlan` holds the target's files and, for every flat tensor in them, the element ranges of
source tensors that land where (zeros elsewhere). Each writer has a pure ``plan_*`` function (no I/O: tested
without files) and tree functions that turn a plan into the trees :func:`dsckpt.writers.torch_stream.write_torch_tree`
streams: source tensors are referenced by byte range, never loaded, so writing is a torch-free byte copy with CRC
checks. The one exception: a ZeRO-3 source written as ZeRO-1/2 in 16-bit needs the module's 16-bit params, which
only exist as the fp32 master there; they are cast with torch, one file's worth in memory.

:func:`build_jobs` produces ``(path, tree)`` per target file. ``dsckpt reshard`` (:mod:`dsckpt.reshard`) is only
describe -> resolve -> :func:`plan_layout` -> write -> verify.

Stage changes: the fp32 master, Adam moments and step are layout-independent in the logical
checkpoint, so any ZeRO stage 1-3 source can be planned for any stage 1-3 target. What a layout
stores besides them (loss scaler, ``clip_grad``, optimizer hyperparameters, client state) is carried
over by :func:`~.common.optimizer_scalars`; what the target layout has and the source does not is
set to DeepSpeed's own value for the target (e.g. a static ``LossScaler(1.0)`` for a bf16
``BF16_Optimizer`` source written as ZeRO). A stage-0 source (fp32 or bf16; :func:`.stage0.stage0_as_zero_source`)
is written as ZeRO-1/2/3 from its fp32 masters (the module weights at fp32) and the optimizer state inside its
model-states file (:func:`~.common.stage0_scalars`); a ZeRO source written as stage 0 gets one model-states file
with the full module and the stage-0 optimizer's state dict (:func:`.stage0.plan_stage0_from_zero`); a pipeline
(and tensor x pipeline) run is written so per model-parallel rank, each stage's file naming its optimizer's params in
``param_shapes`` (:data:`.stage0.PIPELINE_NOTE`). Which source order each optimizer group is planned in is decided
in one place for every target (:func:`source_group_orders`).

Issue 41 (this design) counted the kind tests of ``ds_writers/`` and ``reshard.py`` before and after; the counts are
in ``docs/design.md``.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..model import LogicalCheckpoint, Role
from ..parallel_layout import AutoEpLayout, ParallelTarget
from ..partition import undo_round_robin
from .plan import (
    BF16_WRAPPER,
    FlatSpec,
    GroupPartition,
    LayoutPlan,
    ModuleSource,
    RangeCopy,
    RankPlan,
    SourceFacts,
    Target,
    module_source_of,
    source_layout_stage,
    source_model_files,
    source_optim_files,
)
from .source import SourceDescription
from .stage0 import STAGE0_BF16_PIPELINE_NOTE

__all__ = [
    "STAGE0_BF16_PIPELINE_NOTE",
    "FlatSpec",
    "GroupPartition",
    "LayoutPlan",
    "RangeCopy",
    "RankPlan",
    "SourceFacts",
    "Target",
    "build_jobs",
    "plan_layout",
    "source_layout_stage",
]



def plan_layout(src: SourceDescription, target: Target, common: Mapping[str, Any]) -> LayoutPlan:
    """Phase 3: plan every file of ``target`` from the source ``src``. Pure: no tensor or file I/O, no refusal
    (phase 2 refused what cannot be written) and no question of what kind of source or target it is beyond the
    target's own records.

    ``common``: the :class:`LayoutPlan` fields that do not depend on the layout (paths, tag, the Trainer files
    plan). A target with TP or stages (``target.parallel.model_parallel``) is written per model-parallel rank: each
    is an ordinary data-parallel checkpoint of that rank's params and local slices (:func:`.retarget.rank_view`),
    planned by the same writers into files named ``..._mp_rank_{m:02d}_...`` (:attr:`LayoutPlan.mp_ranks`).
    """
    ckpt, facts = src.ckpt, src.facts
    if target.moe_recut:  # native MoE at another expert-parallel size: the source read at the target's expert cut
        from .moe import retarget_moe

        assert target.parallel.ep_size is not None
        ckpt, facts = retarget_moe(ckpt, facts, target.parallel.ep_size, target.world_size)
    common = {**common, "parallel": target.parallel, "scalars_from": target.scalars_from,
              "wording": target.wording}
    if target.parallel.model_parallel:
        return _plan_mp_ranks(ckpt, target, facts, common)
    return _plan_ranks(ckpt, target, facts, common)


def _plan_mp_ranks(ckpt: LogicalCheckpoint, target: Target, facts: SourceFacts,
                   common: Mapping[str, Any]) -> LayoutPlan:
    """One data-parallel plan per target model-parallel rank ``m = stage * tp + t`` (pipeline stage, TP rank), each
    from that rank's view of ``ckpt`` (:func:`.retarget.rank_view`: the stage's params, then TP rank ``t``'s
    slices)."""
    import dataclasses

    from .retarget import rank_view

    parallel: ParallelTarget = common["parallel"]
    src_tp = max(1, ckpt.tp_world_size)
    parts = []
    for m in range(parallel.mp_size):
        view, view_facts = rank_view(ckpt, facts, parallel, m)
        part_common = {**common, "source_optim_files": source_optim_files(view), "mp_rank": m, "hf_files": None,
                       "source_tp_size": src_tp,
                       "source_pp_size": parallel.stages.source_pp_size if parallel.stages else 1}
        if m == 0 and target.copied_layer_files:
            part_common["copied_model_files"] = target.copied_layer_files
        parts.append(_plan_ranks(view, target, view_facts, part_common))
    return dataclasses.replace(parts[0], ranks=(), mp_ranks=tuple(parts), hf_files=common.get("hf_files"),
                               source_tp_size=src_tp, notes=(*parts[0].notes, *target.model_parallel_notes),
                               copied_model_files=(), recut_layer_files=target.recut_layer_files)


def _plan_ranks(ckpt: LogicalCheckpoint, target: Target, facts: SourceFacts, common: Mapping[str, Any]) -> LayoutPlan:
    """The data-parallel plan of ``ckpt`` (one model-parallel rank's files), by the writer of the target's layout."""
    src_stage = source_layout_stage(ckpt)
    if target.zero_stage == 0 and target.stage0_rebuilt:
        from .stage0 import plan_stage0_from_zero

        ckpt, orders = source_group_orders(ckpt, facts)
        return plan_stage0_from_zero(ckpt, orders, {
            **common, "zero_stage": 0, "optimizer_wrapper": "stage 0", "source_zero_stage": src_stage,
            "module_source": module_source_of(src_stage), "pipeline_stage": ckpt.layout == "pipeline",
            "source_optimizer_wrapper": ckpt.optimizer_wrapper, "source_model_files": source_model_files(ckpt)[:1],
            "stage0_rebuilt": True})
    common = {**common, "zero_stage": target.zero_stage, "optimizer_wrapper": target.optimizer_wrapper,
              "source_zero_stage": src_stage, "source_optimizer_wrapper": ckpt.optimizer_wrapper,
              "module_source": module_source_of(src_stage), "pipeline_stage": ckpt.layout == "pipeline"}
    if target.zero_stage == 0:
        from .stage0 import plan_stage0

        return plan_stage0(ckpt, common)
    ckpt, orders = source_group_orders(ckpt, facts)
    common = {**common, "source_model_files": source_model_files(ckpt)}
    if target.zero_stage == 3:
        from .zero3 import plan_zero3

        return plan_zero3(ckpt, target.world_size, orders, sub_group_size=target.sub_group_size,
                          param_ds_ids=dict(facts.param_ds_ids), source_subgroups=len(facts.group_flat_order),
                          common=common)
    from .zero12 import plan_zero12

    return plan_zero12(ckpt, target.world_size, orders, round_robin=target.round_robin,
                       parameter_alignment=target.parameter_alignment,
                       bf16_optimizer=target.optimizer_wrapper == BF16_WRAPPER, common=common)


def source_group_orders(ckpt: LogicalCheckpoint, facts: SourceFacts) -> tuple[LogicalCheckpoint, list[list[str]]]:
    """``ckpt`` as the source of a plan, and per optimizer param group its trainable params in the source optimizer's
    order. A ZeRO source (or a ``BF16_Optimizer`` one, :func:`source_layout_stage`) as it is, the order from its flat
    buffers (:func:`optimizer_group_orders`); a stage-0 source with the fp32 masters a plan reads
    (:func:`.stage0.stage0_as_zero_source`), the order from its optimizer -- except one stage of an fp32 pipeline
    without ZeRO, whose order is the stage plan's (:func:`.retarget.rank_view` put it in ``facts``: dsckpt's own
    files name the params in ``param_shapes``, DeepSpeed's are bound by :mod:`dsckpt.readers.pipeline_binding`)."""
    src_stage = source_layout_stage(ckpt)
    if src_stage != 0:
        return ckpt, optimizer_group_orders(facts, src_stage, ckpt.dp_world_size,
                                            ckpt.optimizer_wrapper == BF16_WRAPPER)
    from .stage0 import stage0_as_zero_source

    ckpt, orders = stage0_as_zero_source(ckpt)
    if ckpt.layout == "pipeline":
        orders = [list(g) for g in facts.group_flat_order]
    return ckpt, orders


def optimizer_group_orders(facts: SourceFacts, source_stage: int, source_world: int,
                           source_bf16_optimizer: bool) -> list[list[str]]:
    """Per optimizer param group, its trainable params in the optimizer's own order: stage-1/2 flat
    order with round robin undone, or the stage-3 sub-groups of each group joined."""
    if source_stage == 3:
        n_groups = max(facts.subgroup_to_group, default=-1) + 1
        groups: list[list[str]] = [[] for _ in range(n_groups)]
        for s, names in enumerate(facts.group_flat_order):
            groups[facts.subgroup_to_group[s]].extend(names)
        return groups
    out = []
    for src_flat in facts.group_flat_order:
        if facts.round_robin and not source_bf16_optimizer:
            out.append(undo_round_robin(src_flat, source_world))
        else:
            out.append(list(src_flat))
    return out


def build_jobs(plan: LayoutPlan, ckpt: LogicalCheckpoint, tag_dir: Path, cache: Any) -> list[tuple[Path, Any]]:
    """``(path, tree)`` for every target file, in plan order: each model-parallel rank's files from its view of
    ``ckpt`` (:func:`.retarget.rank_view`), every tree's parallel sizes rewritten for the target
    (:func:`.retarget.retarget_tree`). Reads source trees (pickles) through ``cache``, no tensor bytes; not
    thread-safe (the cache is not). Refuses a tree carrying a field DeepSpeed's loader rejects
    (:func:`~dsckpt.validate.refuse_unloadable_fields`) before anything is written."""
    from ..validate import refuse_unloadable_fields
    from .precision import retype_tree
    from .retarget import rank_view, retarget_tree

    facts = SourceFacts((), ())
    jobs: list[tuple[Path, Any]] = []
    for part in plan.parts():
        # a model-parallel rank's trees are recast from its own view's masters (its TP slices, its stage's params)
        view = rank_view(ckpt, facts, plan.parallel, part.mp_rank)[0] if plan.mp_ranks else ckpt
        jobs += [(path, retype_tree(retarget_tree(path.name, tree, part, ckpt.tensor_parallel), plan.precision_change,
                                    view, cache, path.name, ckpt))
                 for path, tree in _build_layout_jobs(part, view, tag_dir, cache)]
    if plan.recut_layer_files:
        from ..tensor_parallel import rank_view as tp_rank_view

        assert plan.parallel.tp is not None
        for t in range(plan.tp_size):
            view = tp_rank_view(ckpt, plan.parallel.tp, t)
            jobs += [(tag_dir / name, tree) for name, tree in layer_file_trees(plan.recut_layer_files, ckpt, view, t,
                                                                                cache)]
    refuse_unloadable_fields(jobs, source=f"'{ckpt.tag_dir}'")
    return jobs


def _build_layout_jobs(plan: LayoutPlan, ckpt: LogicalCheckpoint, tag_dir: Path, cache: Any) -> list[tuple[Path, Any]]:
    jobs: list[tuple[Path, Any]] = []
    if plan.zero_stage == 0 and not plan.stage0_rebuilt:
        from .stage0 import stage0_model_trees

        return [*((tag_dir / name, tree) for name, tree in stage0_model_trees(plan, cache)),
                *_copied(plan, tag_dir, cache)]
    src0, scalars = _optimizer_scalars(plan, ckpt, cache)
    if plan.zero_stage == 0:
        from .stage0 import stage0_trees_from_zero

        return [*((tag_dir / name, tree) for name, tree in stage0_trees_from_zero(plan, ckpt, scalars, cache)),
                *_copied(plan, tag_dir, cache)]
    if plan.zero_stage in (1, 2):
        from .zero12 import zero12_model_tree, zero12_optim_tree

        name, tree = zero12_model_tree(plan, ckpt, cache)
        jobs.append((tag_dir / name, tree))
        jobs += _copied(plan, tag_dir, cache)
        if isinstance(plan.parallel.experts, AutoEpLayout) and plan.module_source is ModuleSource.MASTERS_CAST:
            from .autoep import expert_file_trees

            jobs += [(tag_dir / n, t) for n, t in expert_file_trees(plan, ckpt, cache)]
        for r in plan.ranks:
            assert r.optim_file is not None
            jobs.append((tag_dir / r.optim_file, zero12_optim_tree(plan, r, src0, scalars, cache)))
        return jobs
    from .zero3 import zero3_model_tree, zero3_optim_tree, zero3_swap_jobs

    src_models: Sequence[Any] = [cache.tree(p) for p in plan.source_model_files]
    for r in plan.ranks:
        assert r.model_file is not None and r.optim_file is not None
        jobs.append((tag_dir / r.model_file, zero3_model_tree(plan, r, ckpt, src_models, cache)))
        jobs.append((tag_dir / r.optim_file, zero3_optim_tree(plan, r, src0, scalars, cache)))
        jobs += [(tag_dir / rel, t) for rel, t in zero3_swap_jobs(plan, r, ckpt.ds_config, cache)]
    return jobs


def _optimizer_scalars(plan: LayoutPlan, ckpt: LogicalCheckpoint, cache: Any) -> tuple[Any, Any]:
    """Source rank 0's optimizer file (None where the scalars come from elsewhere) and the scalars the written
    optimizer files get (None: the trees keep the source file's), from where phase 2 decided
    (:attr:`LayoutPlan.scalars_from`)."""
    from .common import optimizer_scalars, stage0_scalars, universal_scalars

    where = plan.scalars_from
    if where == "stage-0 model states":  # the optimizer state is inside the stage-0 model states
        return None, stage0_scalars(cache.tree(plan.source_model_files[0]))
    if where == "universal":  # a universal folder: zero/optimizer_state.pt
        return None, universal_scalars(ckpt, cache)
    src0 = cache.tree(plan.source_optim_files[0])
    return src0, (None if where == "optimizer file, kept" else optimizer_scalars(src0, plan.from_stage))


def layer_file_trees(sources: Sequence[Path], ckpt: LogicalCheckpoint, view: LogicalCheckpoint, t: int,
                     cache: Any) -> list[tuple[str, Any]]:
    """TP rank ``t``'s ``layer_XX-model_{t:02d}-model_states.pt`` files from TP rank 0's ``sources`` (the layer's
    ``state_dict``, keys in its order and its mapping type): each tensor streamed from the module copy of the param
    (or buffer) it holds in ``view`` (TP rank ``t``'s slices, :func:`dsckpt.tensor_parallel.rank_view`), a frozen
    param's (its only copy: no master or optimizer state) cut like a trainable one's by the TP record. Which entry
    a key holds is where the reader found that entry's module copy in ``ckpt`` (``readers/pipeline.py`` named it,
    a tied module's ``tied_modules.<key>.<param>`` included)."""
    import copy
    import re

    from ..tensor_ref import TensorRef
    from .common import streamed
    from .plan import FlatSpec, coalesce, range_copies

    by_name = {e.name: e for e in view.entries}
    held = {(f.file, f.key): e.name for e in ckpt.entries for p in e.pieces if p.role is Role.MODULE
            for f in p.fragments}
    out = []
    for src in sources:
        m = re.match(r"layer_(\d+)-model_00-model_states\.pt$", src.name)
        assert m is not None, src
        tree = copy.copy(cache.tree(src))
        for key in list(tree):
            e = by_name.get(held.get((src, (key,)), ""))
            if e is None:
                if isinstance(tree[key], TensorRef):
                    raise UnsupportedCheckpointError(f"{src}: '{key}' names no param or buffer of the checkpoint; "
                                                     "cannot re-cut it for another TP size")
                continue
            if e.tied_to is not None:
                e = by_name[e.tied_to]
            piece = next((p for p in e.pieces if p.role is Role.MODULE and p.replica == 0), None)
            if piece is None:
                raise UnsupportedCheckpointError(f"{src}: '{key}' ({e.name}) has no module copy to re-cut")
            tree[key] = streamed(FlatSpec(e.numel, piece.dtype, coalesce(range_copies(piece, 0, e.numel, 0, e.name))),
                                 cache, shape=e.shape)
        out.append((f"layer_{m[1]}-model_{t:02d}-model_states.pt", tree))
    return out


def _copied(plan: LayoutPlan, tag_dir: Path, cache: Any) -> list[tuple[Path, Any]]:
    """The plan's files rewritten unchanged (MoE expert files, pipeline layer files), their top-level mapping type
    (a layer file's ``OrderedDict`` state dict) kept."""
    import copy

    return [(tag_dir / src.name, copy.copy(cache.tree(src))) for src in plan.copied_model_files]
