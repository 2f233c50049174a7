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

import math
from collections.abc import Sequence
from dataclasses import dataclass

__all__ = [
    "DEFAULT_SUB_GROUP_SIZE",
    "NCCL_START_ALIGNMENT_FACTOR",
    "FlatGroupLayout",
    "SliceMapping",
    "Span",
    "bf16_optimizer_group_padding",
    "param_alignment_paddings",
    "round_robin_order",
    "split_by_partitions",
    "undo_round_robin",
    "zero3_partition_numel",
    "zero3_spans",
    "zero3_sub_groups",
    "zero12_group_layout",
    "zero12_param_slice_mappings",
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


# --------------------------------------------------------------------------------------------
# What a re-partition for a new world size has to recompute (DeepSpeed 0.19.8).


def round_robin_order(n_params: int, world_size: int) -> list[int]:
    """Flat-buffer position -> index in the param group under ``round_robin_gradients``.

    ``DeepSpeedZeroOptimizer._round_robin_reorder`` (stage_1_and_2.py:901-922) deals param ``i`` to
    bucket ``i % world_size`` and lays the buckets out in order, so the flat order depends on the
    world size.
    """
    if world_size < 1:
        raise ValueError("world_size must be >= 1")
    return [i for j in range(min(world_size, n_params)) for i in range(j, n_params, world_size)]


def undo_round_robin(flat: Sequence[str], world_size: int) -> list[str]:
    """A param group's names in the optimizer's own order, from their flat order under ``round_robin_gradients``
    at ``world_size`` (the inverse of :func:`round_robin_order`)."""
    original = [""] * len(flat)
    for pos, idx in enumerate(round_robin_order(len(flat), world_size)):
        original[idx] = flat[pos]
    return original


def param_alignment_paddings(numels: Sequence[int], element_nbytes: int, *, enabled: bool) -> list[int]:
    """Zeros after each param (flat order) under ``zero_optimization.parameter_alignment``.

    stage_1_and_2.py:441-501: ``alignment = 16 // gcd(16, element_size)`` elements; each param but the
    last is followed by ``(-running_offset) % alignment`` zeros. All zero when disabled.
    """
    if not enabled:
        return [0] * len(numels)
    alignment = 16 // math.gcd(16, element_nbytes)
    out = []
    offset = 0
    for i, n in enumerate(numels):
        offset += n
        pad = 0 if i == len(numels) - 1 else (-offset) % alignment
        out.append(pad)
        offset += pad
    return out


def bf16_optimizer_group_padding(layout: FlatGroupLayout, rank: int) -> int:
    """``BF16_Optimizer``'s ``group_paddings`` entry: all the group padding on the last rank, 0 elsewhere
    (bf16_optimizer.py:209-215), unlike ZeRO's per-rank count."""
    if rank == layout.world_size - 1:
        return layout.padded_numel - layout.unpadded_numel
    return 0


@dataclass(frozen=True)
class SliceMapping:
    """One ``param_slice_mappings`` entry: param ``index`` (bit16-group order) has ``numel`` elements
    at ``start`` of the rank's fp32 partition."""

    index: int
    start: int
    numel: int


def zero12_param_slice_mappings(numels: Sequence[int], partition_start: int, partition_numel: int,
                                param_offsets: Sequence[int] | None = None) -> list[SliceMapping]:
    """DeepSpeed's ``param_slice_mappings`` for one group and rank, reproduced bug for bug.

    ``numels`` are in ``bit16_groups`` order (the param group's order, *not* the flat order).
    ``_link_all_hp_params`` passes ``param_offsets`` (the real flat offsets) only when some
    ``param_alignment_paddings`` entry is non-zero; otherwise ``_init_lp_to_hp_mapping``
    (utils/mixed_precision_linkage.py:40-100) accumulates offsets in ``bit16_groups`` order, which
    is wrong under ``round_robin_gradients`` -- what DeepSpeed 0.19.8 saves, and what we write.
    """
    out = []
    partition_end = partition_start + partition_numel
    offset = 0
    for i, n in enumerate(numels):
        if param_offsets is not None:
            offset = param_offsets[i]
        end = offset + n
        in_partition = partition_start <= offset < partition_end or offset < partition_start < end
        if in_partition and n > 0:
            lo = max(offset, partition_start)
            hi = min(end, partition_end)
            out.append(SliceMapping(i, lo - partition_start, hi - lo))
        if param_offsets is None:
            offset += n
    return out


#: DeepSpeed 0.19.8 default of ``zero_optimization.sub_group_size`` (runtime/zero/config.py).
DEFAULT_SUB_GROUP_SIZE = 1_000_000_000


def zero3_sub_groups(numels: Sequence[int], world_size: int, sub_group_size: int | None) -> list[list[int]]:
    """Indices of one param group's params in each ZeRO-3 sub-group for ``world_size`` ranks.

    ``_create_fp16_sub_groups`` (stage3.py:1210-1233) counts *partition* sizes
    (``ceil(numel / ws)``), so the sub-groups change with the world size.
    """
    parts = [zero3_partition_numel(n, world_size) for n in numels]
    if not numels:
        return []
    if sub_group_size is None or sub_group_size >= sum(parts):
        return [list(range(len(numels)))]
    groups: list[list[int]] = []
    current: list[int] = []
    size = 0
    for i, p in enumerate(parts):
        current.append(i)
        size += p
        if size >= sub_group_size or i == len(numels) - 1:
            groups.append(current)
            current = []
            size = 0
    return groups
