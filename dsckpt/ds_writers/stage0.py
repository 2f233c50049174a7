"""Stage-0 writer (no ZeRO; the mirror of :mod:`dsckpt.readers.stage0`): nothing is partitioned, the
whole module and optimizer live in ``mp_rank_00_model_states.pt``; only the recorded
``dp_world_size`` (the resume guard, engine.py:4744-4753) depends on the world size."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..model import LogicalCheckpoint
from .moe import copied_files, expert_group_sizes
from .plan import LayoutPlan

__all__ = ["plan_stage0", "stage0_model_trees"]


def plan_stage0(ckpt: LogicalCheckpoint, common: Mapping[str, Any]) -> LayoutPlan:
    models = tuple(p for p in ckpt.files if p.name.startswith("mp_rank_") and p.name.endswith("_model_states.pt"))
    notes = ["stage 0: nothing is partitioned; only the recorded dp_world_size changes"]
    copied: tuple[Path, ...] = ()
    if ckpt.moe is not None:  # expp_rank_{R} files belong to expert-parallel ranks, which are kept
        expert_group_sizes(ckpt, common["world_size"])
        copied = copied_files(ckpt, stage0=True)
        notes.append(f"Mixture of Experts: expert-parallel size kept at {', '.join(map(str, ckpt.moe.ep_sizes))}; "
                     f"the {len(copied)} expert and expert-parallel optimizer files are copied unchanged")
    return LayoutPlan(**{**common, "source_model_files": models}, param_shapes=(), subgroup_to_group=(),
                      alignment_paddings=(), ranks=(), notes=tuple(notes), copied_model_files=copied)


def stage0_model_trees(plan: LayoutPlan, cache: Any) -> Iterator[tuple[str, dict[str, Any]]]:
    for src in plan.source_model_files:
        tree = dict(cache.tree(src))
        tree["dp_world_size"] = plan.world_size
        yield src.name, tree
