"""Pure expert-parallel (MoE) rank arithmetic of DeepSpeed 0.19.8. No I/O, no torch.

DeepSpeed's native MoE (``deepspeed.moe.layer.MoE``) splits ``num_experts`` experts over the
``ep_size`` ranks of an *expert-parallel* group (``num_experts / ep_size`` local experts each,
named ``deepspeed_experts.0 ..`` on every rank); the ranks that hold the same experts form an
*expert-data-parallel* group of ``world / ep_size`` ranks, over which ZeRO partitions the expert
param groups. ``utils/groups.py::_create_expert_and_data_parallel`` (legacy path, no TP/PP) builds:

* default (E + D): expert-parallel groups ``[i*E, (i+1)*E)``; expert-data-parallel groups
  ``range(i, world, E)``. So ``ep_rank = rank % E`` and ``expert_dp_rank = rank // E``.
* ``"use_data_before_expert_parallelism": true`` (D + E): with ``stride = world / E``, expert-data-
  parallel groups ``[i*stride, (i+1)*stride)`` and expert-parallel groups ``range(i, world, stride)``.
  So ``ep_rank = rank // stride`` and ``expert_dp_rank = rank % stride``.

A rank's rank inside a group (``dist.get_rank(group)``, used by ``_get_expert_parallel_rank`` /
``_get_expert_data_parallel_rank``) is its position in the group's sorted rank list.
``engine.py::_save_moe_checkpoint`` names local expert ``l`` of expert-parallel rank ``r``
``r * num_local_experts + l`` in the ``layer_{L}_expert_{E}_mp_rank_00_model_states.pt`` files.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "EXPERT_NAME",
    "ExpertTopology",
    "expert_data_parallel_rank",
    "expert_data_parallel_ranks",
    "expert_parallel_rank",
    "global_expert_name",
    "local_expert_id",
]

# engine.py::_save_moe_checkpoint: moe_str_prefix = '.deepspeed_moe.experts.deepspeed_experts.'
EXPERT_NAME = re.compile(r"^(?P<prefix>.*\.deepspeed_moe\.experts\.deepspeed_experts\.)(?P<id>\d+)(?P<rest>\..+)$")


@dataclass(frozen=True)
class ExpertTopology:
    """How ``world_size`` data-parallel ranks split into expert-parallel groups of ``ep_size``."""

    world_size: int
    ep_size: int
    data_before_expert: bool = False  # ds_config "use_data_before_expert_parallelism"

    def __post_init__(self) -> None:
        if self.ep_size < 1 or self.world_size < 1 or self.world_size % self.ep_size:
            raise ValueError(f"ep_size {self.ep_size} does not divide world size {self.world_size}")

    @property
    def expert_dp_size(self) -> int:
        return self.world_size // self.ep_size


def expert_parallel_rank(rank: int, topo: ExpertTopology) -> int:
    """``groups._get_expert_parallel_rank``: which experts ``rank`` holds."""
    if topo.data_before_expert:
        return rank // topo.expert_dp_size
    return rank % topo.ep_size


def expert_data_parallel_rank(rank: int, topo: ExpertTopology) -> int:
    """``groups._get_expert_data_parallel_rank``: ``rank``'s ZeRO partition index of the expert groups."""
    if topo.data_before_expert:
        return rank % topo.expert_dp_size
    return rank // topo.ep_size


def expert_data_parallel_ranks(ep_rank: int, topo: ExpertTopology) -> list[int]:
    """The data-parallel ranks holding expert-parallel rank ``ep_rank``'s experts, in partition order
    (index ``k`` holds partition ``k`` of each expert param group)."""
    ranks = [r for r in range(topo.world_size) if expert_parallel_rank(r, topo) == ep_rank]
    return sorted(ranks, key=lambda r: expert_data_parallel_rank(r, topo))


def local_expert_id(name: str) -> int | None:
    m = EXPERT_NAME.match(name)
    return int(m["id"]) if m else None


def global_expert_name(local_name: str, ep_rank: int, num_local_experts: int) -> str:
    """The name a one-rank model gives local expert param ``local_name`` of expert-parallel rank ``ep_rank``."""
    m = EXPERT_NAME.match(local_name)
    if m is None:
        raise ValueError(f"'{local_name}' is not an expert parameter name")
    return f"{m['prefix']}{ep_rank * num_local_experts + int(m['id'])}{m['rest']}"
