"""The expert dimension of the ZeRO-1/2/3 writers, in one place: per param group, which ranks partition it and which
entries a rank holds there (dense, native MoE: :mod:`.moe`, AutoEP: :mod:`.autoep`), which expert files are copied and
what the plan says about them. The writers (:mod:`.zero12`, :mod:`.zero3`) ask :func:`expert_groups` and
:func:`expert_files_and_note`; neither asks what kind of experts the checkpoint has.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ..model import LogicalCheckpoint, TensorEntry
from ..parallel_layout import AutoEpLayout, ParallelTarget

__all__ = ["ExpertGroups", "expert_files_and_note", "expert_groups"]


@dataclass(frozen=True)
class ExpertGroups:
    """``group_ep``: per param group its expert-parallel size (None: a dense group, partitioned over every rank).
    ``position(g, rank)``: the rank's partition index in group ``g`` and the entry it holds there for each name."""

    group_ep: Sequence[int | None]
    position: Callable[[int, int], tuple[int, Callable[[str], TensorEntry]]]

    def ep(self, g: int) -> int | None:
        return self.group_ep[g] if g < len(self.group_ep) else None

    def partition_count(self, g: int, world: int) -> int:
        """The ranks group ``g`` is partitioned over: the expert-data-parallel group of an expert group."""
        ep = self.ep(g)
        return world // ep if ep else world


def expert_groups(ckpt: LogicalCheckpoint, world: int, group_orders: Sequence[Sequence[str]],
                  parallel: ParallelTarget) -> ExpertGroups:
    """The :class:`ExpertGroups` of ``ckpt`` on ``world`` data-parallel ranks at the target's expert cut."""
    if ckpt.autoep is not None:
        from .autoep import autoep_groups

        group_ep, autoep_position = autoep_groups(ckpt, world, group_orders, parallel.experts)  # type: ignore[arg-type]

        def position(g: int, rank: int) -> tuple[int, Callable[[str], TensorEntry]]:
            k, ents = autoep_position(g, rank)
            return k, ents.__getitem__
        return ExpertGroups(group_ep, position)
    from .moe import expert_group_sizes, rank_in_group

    by_name = {e.name: e for e in ckpt.entries}
    sizes = expert_group_sizes(ckpt, world)  # native MoE (refuses a world size its expert-parallel size does not
    # divide), or none

    def moe_position(g: int, rank: int) -> tuple[int, Callable[[str], TensorEntry]]:
        k, resolve = rank_in_group(ckpt, world, rank, sizes[g] if g < len(sizes) else None)
        return k, lambda nm: by_name[resolve(nm)]
    return ExpertGroups(sizes, moe_position)


def expert_files_and_note(ckpt: LogicalCheckpoint, world: int, parallel: ParallelTarget,
                          copied: tuple[Path, ...]) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """The ZeRO-1/2 plan's files copied unchanged (``copied`` and the expert files) and its note on the experts."""
    if ckpt.autoep is not None:
        ae, tgt = ckpt.autoep, parallel.experts
        assert isinstance(tgt, AutoEpLayout)
        files = ae.expert_files
        return files, (f"AutoEP: expert-parallel size {ae.ep_size} -> {tgt.ep_size} (expert-data-parallel "
                       f"{ae.expert_dp} -> {tgt.expert_dp}); the {len(files)} per-expert files are copied unchanged",)
    if ckpt.moe is None:
        return copied, ()
    from .moe import copied_files, moe_note

    files = (*copied, *copied_files(ckpt, stage0=False))
    ep = parallel.ep_size
    if ep is None:
        return files, (moe_note(ckpt, world, len(files)),)
    return files, (f"Mixture of Experts: expert-parallel size changed to {ep} (expert-data-parallel {world // ep}); "
                   f"the {len(files)} per-expert files are copied unchanged",)
