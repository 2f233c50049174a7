"""Pure ZeRO partition arithmetic (DeepSpeed 0.19.8). No I/O, no torch.

Stage 1/2 (stage_1_and_2.py:387-508, runtime/utils.py:994-1005): per param group, the trainable
params are laid end to end in flat-buffer order, each followed by its ``parameter_alignment``
padding; the group is zero-padded to a multiple of ``2 * dp_world_size``
(``nccl_start_alignment_factor = 2``) and cut into ``dp_world_size`` equal partitions.

Stage 3 (partition_parameters.py:1690-1696): every param is cut on its own into ``ceil(numel / ws)``
elements per rank, padding at the end of the last rank(s); a rank's fp32 sub-group is the
concatenation of its pieces of that sub-group's params.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "NCCL_START_ALIGNMENT_FACTOR",
    "Span",
    "FlatGroupLayout",
    "zero12_group_layout",
    "zero3_partition_numel",
    "zero3_spans",
    "split_by_partitions",
]

NCCL_START_ALIGNMENT_FACTOR = 2


@dataclass(frozen=True)
class Span:
    """``numel`` elements at ``src_offset`` of rank ``rank``'s flat tensor that hold elements
    ``[dst_offset, dst_offset + numel)`` of a param."""

    rank: int
    src_offset: int
    numel: int
    dst_offset: int


@dataclass(frozen=True)
class FlatGroupLayout:
    """Where each param of one stage-1/2 group sits in the group's flat buffer."""

    param_offsets: tuple[int, ...]
    param_numels: tuple[int, ...]
    unpadded_numel: int  # params + alignment paddings, before the group padding
    padded_numel: int  # a multiple of 2 * world_size
    world_size: int

    @property
    def partition_numel(self) -> int:
        return self.padded_numel // self.world_size

    def rank_padding(self, rank: int) -> int:
        """Padding elements in ``rank``'s partition (DeepSpeed's ``group_paddings``)."""
        start = rank * self.partition_numel
        end = start + self.partition_numel
        return end - max(start, min(end, self.unpadded_numel))


def zero12_group_layout(
    numels: Sequence[int],
    world_size: int,
    *,
    alignment_paddings: Sequence[int] | None = None,
) -> FlatGroupLayout:
    """Layout of one stage-1/2 param group for ``world_size`` ranks."""
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    offsets = []
    offset = 0
    for i, n in enumerate(numels):
        offsets.append(offset)
        offset += n
        if alignment_paddings is not None:
            offset += alignment_paddings[i]
    align = NCCL_START_ALIGNMENT_FACTOR * world_size
    padded = -(-offset // align) * align
    return FlatGroupLayout(tuple(offsets), tuple(numels), offset, padded, world_size)


def split_by_partitions(start: int, numel: int, partition_starts: Sequence[int],
                        partition_numels: Sequence[int]) -> list[Span]:
    """Cut the flat range ``[start, start + numel)`` at partition boundaries."""
    spans = []
    end = start + numel
    for rank, (p_start, p_numel) in enumerate(zip(partition_starts, partition_numels)):
        lo = max(start, p_start)
        hi = min(end, p_start + p_numel)
        if lo < hi:
            spans.append(Span(rank, lo - p_start, hi - lo, lo - start))
    return spans


def zero3_partition_numel(numel: int, world_size: int) -> int:
    """Elements of one param per rank, padding included: ``ceil(numel / world_size)``."""
    return -(-numel // world_size)


def zero3_spans(numel: int, world_size: int, offset_in_rank_group: int) -> list[Span]:
    """Pieces of a stage-3 param that sits at ``offset_in_rank_group`` of every rank's flat group."""
    per_rank = zero3_partition_numel(numel, world_size)
    spans = []
    for rank in range(world_size):
        valid = max(0, min(per_rank, numel - rank * per_rank))
        if valid:
            spans.append(Span(rank, offset_in_rank_group, valid, rank * per_rank))
    return spans
