"""Mixture-of-Experts pieces of the ZeRO-1/2 and stage-0 writers (the mirror of :mod:`dsckpt.readers.moe`).

Each expert param group is re-partitioned over the new expert-data-parallel size (``world / ep_size``,
its ``partition_count``), every target rank holding its expert-parallel rank's experts under their
*local* names (:mod:`dsckpt.parallel_layout`: the same rank arithmetic and expert cut as the reader, in
the other direction); the ``layer_*_expert_*`` files (per *global* expert, and at stage 0 the
``expp_rank_*`` optimizer files) are copied. Another expert-parallel size (``--ep-size``, ZeRO-1/2) is
the same plan on the logical checkpoint with its expert cut at that size (:func:`retarget_moe`): the
entries carry global names, so only the cut, the expert groups' local names and their name
(``ep_size_E``) change.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..model import LogicalCheckpoint
from ..parallel_layout import EXPERT_NAME, ParallelLayout, global_expert_name, local_expert_name

__all__ = ["at_expert_cut", "copied_files", "ep_size_refusal", "expert_group_ids", "expert_group_sizes",
           "expp_rank_orders", "held_by_ep_rank_0", "moe_layout_at", "moe_note", "moe_stage0_refusal",
           "moe_world_refusal", "rank_in_group", "rename_expert_groups", "retarget_moe", "stage0_expp_files",
           "stage0_kept_files"]


def expert_group_sizes(ckpt: LogicalCheckpoint, world: int) -> list[int | None]:
    """Per param group: its expert-parallel size (kept), or None for a dense group; refuses target
    sizes the expert-parallel size does not divide."""
    if ckpt.moe is None:
        return []
    why = moe_world_refusal(ckpt, world)  # a row of .target.RULES: refused before any writer plans
    if why is not None:
        raise UnsupportedCheckpointError(why)
    return list(ckpt.moe.group_ep_sizes)


def moe_world_refusal(ckpt: LogicalCheckpoint, world: int) -> str | None:
    """Why native MoE ``ckpt``'s expert cut, kept, cannot be written on ``world`` data-parallel ranks (None: it can,
    or it has no experts): every expert group's expert-parallel size must divide the world size."""
    if ckpt.moe is None:
        return None
    bad = sorted({ep for ep in ckpt.moe.group_ep_sizes if ep is not None and world % ep})
    if bad:
        return (f"cannot reshard '{ckpt.tag_dir}' to {world} ranks: its experts are split over expert-parallel "
                f"size {bad[0]}, which must divide the new world size; pick a multiple of {bad[0]}, or another "
                "expert-parallel size with --ep-size")
    return None


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


def ep_size_refusal(ckpt: LogicalCheckpoint, ep: int, world: int) -> str | None:
    """Why native MoE ``ckpt`` cannot be written at expert-parallel size ``ep`` on ``world`` data-parallel ranks
    (None: it can): every layer's experts and the world size must split over ``ep`` ranks."""
    moe = ckpt.moe
    assert moe is not None
    bad = [p for p, n, _ in moe.layers if n % ep]
    if bad or world % ep:
        return (f"cannot reshard '{ckpt.tag_dir}' to expert-parallel size {ep} on {world} ranks: "
                + (f"the {moe.layers[0][1]} experts of '{bad[0]}' do not split over {ep} ranks" if bad else
                   "the expert-parallel size must divide the world size") + "; pick an --ep-size that divides both")
    return None


def retarget_moe(ckpt: LogicalCheckpoint, facts: Any, ep: int, world: int) -> tuple[LogicalCheckpoint, Any]:
    """``ckpt`` and its source facts with every expert group at expert-parallel size ``ep`` (on ``world``
    data-parallel ranks): the :class:`MoeLayout`'s cut
    sizes, and each expert group's flat order rebuilt as the new expert-parallel rank 0 lists it (its local
    experts ``0 .. n/E - 1`` in order, each with the source's per-expert param order). A stage-0 source has no flat
    order in its facts: :func:`~.stage0.stage0_as_zero_source` takes each expert group in module order; a stage-0
    target gets one ``expp_rank_*`` file per new expert-parallel rank (:func:`~.stage0.stage0_trees_from_zero`)."""
    import dataclasses

    moe = ckpt.moe
    assert moe is not None
    message = ep_size_refusal(ckpt, ep, world)
    if message is not None:
        raise UnsupportedCheckpointError(message)
    new_moe = moe_layout_at(moe, ep)
    n_of = {p: n for p, n, _ in moe.layers}
    orders = []
    for g, names in enumerate(facts.group_flat_order):
        if g >= len(moe.group_ep_sizes) or moe.group_ep_sizes[g] is None:
            orders.append(tuple(names))
            continue
        prefixes: list[str] = []
        rests: dict[str, list[str]] = {}
        for name in names:
            m = EXPERT_NAME.match(name)
            if m is None:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': '{name}' sits in an expert group but is no expert "
                                             "param")
            if m["prefix"] not in rests:
                prefixes.append(m["prefix"])
                rests[m["prefix"]] = []
            if int(m["id"]) == 0:
                rests[m["prefix"]].append(m["rest"])
        orders.append(tuple(f"{p}{local}{rest}" for p in prefixes for local in range(n_of[p] // ep)
                            for rest in rests[p]))
    return dataclasses.replace(ckpt, moe=new_moe), dataclasses.replace(facts, group_flat_order=tuple(orders))


def moe_layout_at(moe: Any, ep: int) -> Any:
    """``moe`` (a :class:`~dsckpt.parallel_layout.MoeLayout`) with every expert group and layer at expert-parallel
    size ``ep``."""
    import dataclasses

    return dataclasses.replace(moe, group_ep_sizes=tuple(ep if e is not None else None for e in moe.group_ep_sizes),
                               layers=tuple((p, n, ep) for p, n, _ in moe.layers))


def rename_expert_groups(tree: Any, ep: int) -> Any:
    """An optimizer tree with its expert param groups named ``ep_size_{ep}`` (groups.py names an expert group by its
    expert-parallel size; ``split_params_into_different_moe_groups_for_optimizer`` gives the param group that name):
    a ZeRO optimizer file's, or the stage-0 ``optimizer`` of an ``expp_rank_*`` / ``mp_rank_*`` file (a torch
    optimizer's state dict, or ``FP16_*Optimizer``'s around one)."""
    from .common import OSD

    if isinstance(tree, dict) and isinstance(tree.get("optimizer"), dict):
        opt = tree["optimizer"]
        wrapped = isinstance(opt.get(OSD), dict)
        inner = opt[OSD] if wrapped else opt
        if not isinstance(inner.get("param_groups"), list):
            return tree
        groups = [{**pg, "name": f"ep_size_{ep}"} if isinstance(pg, dict) and pg.get("moe") else pg
                  for pg in inner["param_groups"]]
        inner = {**inner, "param_groups": groups}
        return {**tree, "optimizer": {**opt, OSD: inner} if wrapped else inner}
    osd = tree.get(OSD) if isinstance(tree, dict) else None
    base = osd.get("base_optimizer_state") if isinstance(osd, dict) else None
    if not isinstance(osd, dict) or not isinstance(base, dict) or not isinstance(base.get("param_groups"), list):
        return tree
    groups = [{**pg, "name": f"ep_size_{ep}"} if isinstance(pg, dict) and pg.get("moe") else pg
              for pg in base["param_groups"]]
    return {**tree, OSD: {**osd, "base_optimizer_state": {**base, "param_groups": groups}}}


# --------------------------------------------------------------------------------------------
# Stage 0 (ds_writers/stage0.py): the expp_rank_* optimizer files, one per expert-parallel rank


def stage0_kept_files(ckpt: LogicalCheckpoint, world: int) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """A stage-0 source rewritten at stage 0: the files copied unchanged (the experts' and the ``expp_rank_*``
    optimizer files, which belong to expert-parallel ranks, which are kept) and the plan's note; none without MoE.
    Refuses a world size the expert-parallel size does not divide."""
    if ckpt.moe is None:
        return (), ()
    expert_group_sizes(ckpt, world)
    copied = copied_files(ckpt, stage0=True)
    return copied, (f"Mixture of Experts: expert-parallel size kept at {', '.join(map(str, ckpt.moe.ep_sizes))}; "
                    f"the {len(copied)} expert and expert-parallel optimizer files are copied unchanged",)


def moe_stage0_refusal(ckpt: LogicalCheckpoint) -> str | None:
    """Why native MoE ``ckpt`` cannot be rebuilt as stage 0 (None: it can, or it has no experts): several
    expert-parallel sizes. (A world size its expert-parallel size does not divide: :func:`moe_world_refusal`.)"""
    if ckpt.moe is None:
        return None
    if len(ckpt.moe.ep_sizes) != 1:
        return (f"expert groups of several expert-parallel sizes {list(ckpt.moe.ep_sizes)}: without ZeRO DeepSpeed "
                "keeps one expp_rank_* optimizer file per rank of one of them")
    return None


def stage0_expp_files(ckpt: LogicalCheckpoint, copied: tuple[Path, ...]) -> tuple[tuple[Path, ...], tuple[str, ...]]:
    """A stage-0 target rebuilt from the logical checkpoint: the files copied unchanged (``copied`` and the expert
    files) and the plan's note on the ``expp_rank_*`` files written."""
    if ckpt.moe is None:
        return copied, ()
    copied = (*copied, *copied_files(ckpt, stage0=False))
    return copied, (f"Mixture of Experts: expert-parallel size kept at {ckpt.moe.ep_sizes[0]}; one expp_rank_* "
                    "optimizer file per expert-parallel rank (the dense groups and that rank's experts); the "
                    f"{len(copied)} expert files are copied unchanged",)


def expert_group_ids(ckpt: LogicalCheckpoint) -> set[int]:
    """The optimizer param groups holding experts (none without MoE)."""
    if ckpt.moe is None:
        return set()
    return {g for g, ep in enumerate(ckpt.moe.group_ep_sizes) if ep is not None}


def at_expert_cut(ckpt: LogicalCheckpoint, parallel: Any) -> LogicalCheckpoint:
    """``ckpt`` with native MoE's expert cut at the target's (``--ep-size``: :attr:`ParallelTarget.experts`)."""
    import dataclasses

    from ..parallel_layout import MoeLayout

    if isinstance(parallel.experts, MoeLayout) and ckpt.moe is not None:
        return dataclasses.replace(ckpt, moe=parallel.experts)
    return ckpt


def expp_rank_orders(ckpt: LogicalCheckpoint, orders: list[list[str]]) -> list[list[list[str]]] | None:
    """Per expert-parallel rank, the optimizer groups of its ``expp_rank_*`` file: ``orders`` with each expert
    group's local names as that rank's global ones; None without MoE."""
    if ckpt.moe is None:
        return None
    moe = ckpt.moe
    return [[[_on_ep_rank(ckpt, n, r) if moe.group_ep_sizes[g] else n for n in names]
             for g, names in enumerate(orders)] for r in range(moe.ep_sizes[0])]


def _on_ep_rank(ckpt: LogicalCheckpoint, local: str, ep_rank: int) -> str:
    """The global name of expert param ``local`` (as ``param_shapes`` names it) on expert-parallel rank ``ep_rank``."""
    assert ckpt.moe is not None
    m = EXPERT_NAME.match(local)
    if m is None:
        raise CorruptCheckpointError(f"'{ckpt.tag_dir}': '{local}' sits in an expert group but is no expert param")
    return global_expert_name(local, ep_rank, ckpt.moe.expert_cut(m["prefix"]))
