"""Mixture-of-Experts pieces of the ZeRO-1/2 and stage-0 writers (the mirror of :mod:`dsckpt.readers.moe`).

The expert-parallel size is kept: each expert param group is re-partitioned over the new
expert-data-parallel size (``world / ep_size``, its ``partition_count``), every target rank holding
its expert-parallel rank's experts under their *local* names (:mod:`dsckpt.parallel_layout`: the same
rank arithmetic and expert cut as the reader, in the other direction);
the ``layer_*_expert_*`` files (and at stage 0 the ``expp_rank_*`` optimizer files) are copied.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..model import LogicalCheckpoint
from ..parallel_layout import EXPERT_NAME, ParallelLayout, global_expert_name, local_expert_name

__all__ = ["copied_files", "expert_group_sizes", "held_by_ep_rank_0", "moe_note", "rank_in_group"]


def expert_group_sizes(ckpt: LogicalCheckpoint, world: int) -> list[int | None]:
    """Per param group: its expert-parallel size (kept), or None for a dense group; refuses target
    sizes the expert-parallel size does not divide."""
    if ckpt.moe is None:
        return []
    bad = sorted({ep for ep in ckpt.moe.group_ep_sizes if ep is not None and world % ep})
    if bad:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to {world} ranks: its experts are split over expert-parallel "
            f"size {bad[0]}, which must divide the new world size, and changing the expert-parallel size is "
            f"not supported; pick a multiple of {bad[0]}")
    return list(ckpt.moe.group_ep_sizes)


def rank_in_group(ckpt: LogicalCheckpoint, world: int, rank: int, ep: int | None) -> tuple[int, Callable[[str], str]]:
    """Target ``rank``'s position in the group's partitioning, and the map from the names in
    ``param_shapes`` to the logical entries it holds: itself for a dense group; for an expert group
    (expert-parallel size ``ep``) its expert-data-parallel rank and the global expert names of its
    expert-parallel rank."""
    if not ep or ckpt.moe is None:
        return rank, lambda name: name
    moe = ckpt.moe
    topo = ParallelLayout(world, ep=ep, data_before_expert=moe.data_before_expert)
    ep_rank = topo.expert_parallel_rank(rank)

    def resolve(name: str) -> str:
        m = EXPERT_NAME.match(name)
        if m is None:
            raise CorruptCheckpointError(f"'{ckpt.tag_dir}': '{name}' sits in an expert group but is no expert param")
        return global_expert_name(name, ep_rank, moe.expert_cut(m["prefix"]))
    return topo.expert_data_parallel_rank(rank), resolve


def held_by_ep_rank_0(ckpt: LogicalCheckpoint, name: str) -> bool:
    """``param_shapes`` lists local expert names, which are expert-parallel rank 0's global ones."""
    m = EXPERT_NAME.match(name)
    if m is None or ckpt.moe is None:
        return True
    return local_expert_name(name, ckpt.moe.expert_cut(m["prefix"]))[0] == 0


def copied_files(ckpt: LogicalCheckpoint, *, stage0: bool) -> tuple[Path, ...]:
    """The expert files (and at stage 0 the expert-parallel optimizer files) copied unchanged."""
    if ckpt.moe is None:
        return ()
    return (*ckpt.moe.expert_files, *(ckpt.moe.expp_optim_files if stage0 else ()))


def moe_note(ckpt: LogicalCheckpoint, world: int, n_copied: int) -> str:
    assert ckpt.moe is not None
    sizes = ", ".join(f"{ep} (expert-data-parallel {ckpt.dp_world_size // ep} -> {world // ep})"
                      for ep in ckpt.moe.ep_sizes)
    return f"Mixture of Experts: expert-parallel size kept at {sizes}; the {n_copied} expert files are copied unchanged"
