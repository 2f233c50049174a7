"""The target's parallel cuts (:class:`~dsckpt.parallel_layout.ParallelTarget`) applied, in one place. Pure: no I/O.

Two directions, each one function composing every dimension:

* :func:`rank_view`: model-parallel rank ``m`` of the target as an ordinary data-parallel checkpoint -- the logical
  checkpoint cut by TP (:func:`dsckpt.tensor_parallel.rank_view`), then by pipeline stage
  (:func:`dsckpt.pipeline_stages.stage_view`). The ZeRO and stage-0 writers plan each such view as they plan a
  checkpoint without TP or stages; the expert cut is planned inside them, per param group (:mod:`.autoep`,
  :mod:`.moe`), since ZeRO partitions an expert group over the ranks holding the same experts.
* :func:`retarget_tree`: a written file's keys that record parallel sizes, rewritten for the target -- the expert
  cut's (AutoEP's record and group names, :func:`.autoep.retarget_tree`; native MoE's group names,
  :func:`.moe.rename_expert_groups`), TP's (:func:`.common.retarget_tp_keys`), then the stage count's
  (:func:`.common.retarget_stage_keys`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from ..model import LogicalCheckpoint
from ..parallel_layout import AutoEpLayout, MoeLayout, ParallelTarget, TpLayout
from ..pipeline_stages import stage_view
from ..tensor_parallel import rank_view as tp_rank_view
from .autoep import retarget_tree as retarget_autoep_keys
from .common import retarget_stage_keys, retarget_tp_keys
from .moe import rename_expert_groups
from .plan import LayoutPlan, SourceFacts

__all__ = ["rank_view", "retarget_tree"]


def rank_view(ckpt: LogicalCheckpoint, facts: SourceFacts, parallel: ParallelTarget,
              mp_rank: int) -> tuple[LogicalCheckpoint, SourceFacts]:
    """Model-parallel rank ``mp_rank`` (stage ``s``, TP rank ``t``: :meth:`ParallelTarget.coordinate`) of the target
    as an ordinary data-parallel checkpoint and its facts: two cuts composed, TP rank ``t``'s slices of every param
    (:func:`dsckpt.tensor_parallel.rank_view`; a pipeline's files are then its TP rank ``t``'s,
    :meth:`~dsckpt.parallel_layout.PipelineRecord.tp_rank`), then the stage's params
    (:func:`dsckpt.pipeline_stages.stage_view`), whose flat order the facts take."""
    stage, t = parallel.coordinate(mp_rank)
    view = ckpt
    if parallel.tp is not None:
        view = tp_rank_view(ckpt, parallel.tp, t)
        if ckpt.pipeline is not None:  # TP rank t's own files (another TP size: source TP rank 0's as templates)
            src_t = t if parallel.tp_size == max(1, ckpt.tp_world_size) else 0
            view = dataclasses.replace(view, files=ckpt.files, pipeline=ckpt.pipeline.tp_rank(src_t))
    if parallel.stages is not None:
        orders = parallel.stages.group_orders[stage]
        view = stage_view(view, parallel.stages, stage)
        facts = dataclasses.replace(facts, group_flat_order=orders, subgroup_to_group=tuple(range(len(orders))))
    return view, facts


def retarget_tree(name: str, tree: Any, plan: LayoutPlan, source_tp: TpLayout | None) -> Any:
    """Target file ``name``'s ``tree`` with every key that records a parallel size rewritten for ``plan.parallel``
    (``source_tp``: the source's TP cut, which a TP record is re-cut from). Each dimension left as the source has it
    rewrites nothing."""
    parallel = plan.parallel
    if isinstance(parallel.experts, AutoEpLayout):
        tree = retarget_autoep_keys(name, tree, plan)
    elif isinstance(parallel.experts, MoeLayout):
        assert parallel.ep_size is not None
        tree = rename_expert_groups(tree, parallel.ep_size)
    if plan.tp_size != plan.source_tp_size:
        tree = retarget_tp_keys(tree, plan, (source_tp, parallel.tp))
    if parallel.stages is not None:
        tree = retarget_stage_keys(name, tree, plan, parallel.stages)
    return tree
