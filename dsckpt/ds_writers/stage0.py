"""Stage-0 writer (no ZeRO; the mirror of :mod:`dsckpt.readers.stage0`): nothing is partitioned, the
whole module and optimizer live in ``mp_rank_00_model_states.pt``; only the recorded
``dp_world_size`` (the resume guard, engine.py:4744-4753) depends on the world size."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..model import Kind, LogicalCheckpoint, Piece, Precision, Role
from .moe import copied_files, expert_group_sizes
from .plan import LayoutPlan

__all__ = ["plan_stage0", "stage0_as_zero_source", "stage0_model_trees", "zero_keys_from_stage0"]


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


def stage0_as_zero_source(ckpt: LogicalCheckpoint) -> tuple[LogicalCheckpoint, list[list[str]]]:
    """A stage-0 save seen as the source of a ZeRO plan: every trainable param has a fp32 master piece (at
    fp32 the module weights are the master, so their piece serves as one), and per optimizer param group its
    params in the optimizer's order (the order of ``fp32_groups[g]``, of the offsets in ``fp32_groups_flat[g]``,
    or of the torch state indices, whichever the save has).

    Refuses fp16 (``FP16_Optimizer``'s dynamic loss scaler would have to become ZeRO's ``DynamicLossScaler``
    object, which no writer here builds) and MoE (expert-parallel optimizer files)."""
    import dataclasses

    if ckpt.precision is Precision.FP16:
        raise UnsupportedCheckpointError(
            f"cannot convert '{ckpt.tag_dir}' from stage 0 to ZeRO: an fp16 stage-0 save keeps its dynamic loss "
            "scale in FP16_Optimizer's own fields, and dsckpt does not build ZeRO's DynamicLossScaler from them; "
            "reshard it at stage 0, or write --universal (DeepSpeed's universal loader starts a fresh loss scale)")
    if ckpt.moe is not None:
        raise UnsupportedCheckpointError(
            f"cannot convert '{ckpt.tag_dir}' (Mixture of Experts) from stage 0 to ZeRO: its expert-parallel "
            "optimizer files (expp_rank_*) are not converted; reshard it at stage 0")
    entries = []
    members: dict[int, list[tuple[tuple[object, ...], str]]] = {}
    for e in ckpt.entries:
        if e.kind is Kind.PARAM and e.trainable and e.tied_to is None:
            master = e.piece(Role.MASTER)
            if master is None:
                module = e.piece(Role.MODULE)
                if module is None or module.dtype != "float32":
                    raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': trainable param '{e.name}' has no fp32 "
                                                     "master and no fp32 module weight")
                master = Piece(Role.MASTER, "float32", module.fragments)
                e = dataclasses.replace(e, pieces=(master, *e.pieces))
            # the optimizer-side position: unfused fp32_groups[g][i], fused offset, or torch state index
            where = (e.piece(Role.EXP_AVG) if ckpt.optimizer_wrapper == "torch optimizer" else master) or master
            f = where.fragments[0]
            key = tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in f.key)
            members.setdefault(e.group if e.group is not None else 0, []).append(((*key, f.src_offset), e.name))
        entries.append(e)
    orders = [[n for _, n in sorted(members[g], key=lambda m: m[0])] for g in sorted(members)]
    return dataclasses.replace(ckpt, entries=tuple(entries)), orders


def zero_keys_from_stage0(tree: dict[str, Any], ckpt: LogicalCheckpoint, rank: int = 0) -> None:
    """A stage-0 model-states tree given the keys a ZeRO one has: no ``optimizer`` (it goes to the optimizer
    files), and ``shared_params`` ({alias: source}) on rank 0, as DeepSpeed computes it (engine.py:5490-5528)."""
    tree["optimizer"] = None
    tree["shared_params"] = {e.name: e.tied_to for e in ckpt.entries if e.tied_to is not None} if rank == 0 else {}
