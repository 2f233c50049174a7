"""AutoEP pieces of the ZeRO-1/2 writer (the mirror of :mod:`dsckpt.readers.autoep`).

Expert parallelism is the same mechanism as tensor parallelism: every expert param is one stacked
``(num_experts, ...)`` logical tensor, cut over the expert index (:func:`~dsckpt.parallel_layout.stacked_expert_cut`)
at the *target* expert-parallel size; target EP rank ``e``'s local experts are a data-parallel view of the logical
checkpoint (:func:`dsckpt.tensor_parallel.rank_view` with that cut, dense params whole), from which the writer plans the
expert group of every rank holding EP rank ``e`` (its expert-data-parallel partitions), as it plans TP ranks. Dense
groups are partitioned over all ranks as usual. What changes with the EP size besides the partitions: the record
(``ds_autoep_layers`` and its copy in ``universal_checkpoint_info``: placement, affine maps, ``num_local_experts``,
``ep_size``, group name, rank-0 coordinates), the expert group's name in the optimizer (``ep_size_E``) and
``expert_parallel.autoep_size`` in the saved config. The ``layer_{L}_expert_{X}`` files are per *global* expert and
are copied unchanged at any EP size. Pure: no I/O.
"""

from __future__ import annotations

import copy
import math
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..model import LogicalCheckpoint, TensorEntry
from ..parallel_layout import (
    AutoEpLayout,
    ParallelLayout,
    ParamCut,
    SplitKind,
    TpLayout,
    stacked_expert_cut,
)

__all__ = ["autoep_groups", "autoep_stage0_refusal", "autoep_target", "retarget_record"]


def autoep_stage0_refusal(ckpt: LogicalCheckpoint) -> str | None:
    """Why ``ckpt`` cannot be rebuilt as stage 0 (None: no AutoEP layout)."""
    return "AutoEP layouts are not converted to stage 0" if ckpt.autoep is not None else None


def autoep_target(ckpt: LogicalCheckpoint, world: int, ep: int | None) -> AutoEpLayout:
    """``ckpt``'s AutoEP layout at expert-parallel size ``ep`` (None: kept) on ``world`` ranks; refuses sizes the
    experts or the world size do not allow."""
    ae = ckpt.autoep
    assert ae is not None
    ep = ae.ep_size if ep is None else ep
    bad = [la.module_path for la in ae.layers if la.num_experts % ep]
    if bad or world % ep:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to expert-parallel size {ep} on {world} ranks: "
            + (f"{ae.layers[0].num_experts} experts per layer do not split over {ep} ranks" if bad else
               "the expert-parallel size must divide the world size") + "; pick an --ep-size that divides both")
    by_name = {e.name: e for e in ckpt.entries}
    cuts = {n: stacked_expert_cut(n, by_name[n].shape, ep) for n in ae.expert_param_names}
    layers = tuple(type(la)(la.module_path, la.layer_id, la.num_experts, ep, la.expert_key_prefix, la.param_names)
                   for la in ae.layers)
    return AutoEpLayout(ep, world // ep, ae.preset, layers, cuts, ae.expert_files)


def autoep_groups(ckpt: LogicalCheckpoint, world: int, group_orders: Sequence[Sequence[str]], target: AutoEpLayout
                  ) -> tuple[list[int | None], Callable[[int, int], tuple[int, Mapping[str, TensorEntry]]]]:
    """Per param group its expert-parallel size (None: dense), and ``position(g, rank)`` -> (the rank's partition
    index in group ``g``, the entries it holds there by name): all ranks and the logical entries for a dense group;
    for the expert group the rank's expert-data-parallel index and its EP rank's local view."""
    from ..tensor_parallel import rank_view

    experts = set(target.expert_param_names)
    group_ep: list[int | None] = []
    for g, names in enumerate(group_orders):
        kinds = {n in experts for n in names}
        if len(kinds) > 1:
            raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': param group {g} mixes expert and dense params")
        group_ep.append(target.ep_size if kinds == {True} else None)
    cuts: dict[str, ParamCut] = {}
    for e in ckpt.entries:
        if e.tied_to is None:
            cuts[e.name] = target.name_to_cut.get(e.name) or ParamCut(
                e.name, SplitKind.REPLICATED, None, e.shape, (e.shape,) * target.ep_size)
    layout = TpLayout(target.ep_size, "autoep", cuts)
    topo = ParallelLayout(world, ep=target.ep_size,
                          data_before_expert=bool((ckpt.ds_config or {}).get("use_data_before_expert_parallelism")))
    dense = {e.name: e for e in ckpt.entries}
    views: dict[int, dict[str, TensorEntry]] = {}

    def position(g: int, rank: int) -> tuple[int, Mapping[str, TensorEntry]]:
        if group_ep[g] is None:
            return rank, dense
        e = topo.expert_parallel_rank(rank)
        if e not in views:
            views[e] = {x.name: x for x in rank_view(ckpt, layout, e).entries}
        return topo.expert_data_parallel_rank(rank), views[e]
    return group_ep, position


def retarget_record(record: Any, target: AutoEpLayout, world: int, rank: int = 0, zero3: bool = False) -> Any:
    """``ds_autoep_layers`` as DeepSpeed 0.19.8 writes it for ``target`` on ``rank`` (ZeRO-1/2: rank 0's, in the one
    ``mp_rank_00`` file; ZeRO-3: each rank's own): contiguous placement, one affine map per expert param
    (autoep_affine.py's lowering: one piece per EP rank), the group name, and the rank's coordinates."""
    if not isinstance(record, list):
        return record
    topo = ParallelLayout(world, ep=target.ep_size)
    ep_rank, edp_rank = topo.expert_parallel_rank(rank), topo.expert_data_parallel_rank(rank)
    out = []
    for entry in record:
        entry = copy.deepcopy(dict(entry))
        layer = next((la for la in target.layers if la.module_path == entry.get("module_path")), None)
        if layer is None:
            out.append(entry)
            continue
        n, ep = layer.num_experts, target.ep_size
        per = n // ep
        entry.update(num_local_experts=per, ep_size=ep)
        entry["expert_placement"] = {"version": 1, "num_experts": n, "ep_size": ep,
                                     "ranks": [{"rank": r, "experts": list(range(r * per, (r + 1) * per))}
                                               for r in range(ep)]}
        maps = entry.get("affine_maps") or {"version": 1, "params": {}}
        entry["affine_maps"] = {**maps, "params": {name: _affine_map(target.name_to_cut[name])
                                                   for name in layer.param_names}}
        if zero3:  # engine.py: the ZeRO-3 record format (experts live in the optimizer partitions only)
            entry.update(checkpoint_format="zero3_partitioned", checkpoint_format_version=1)
        else:
            entry.update(checkpoint_format="per_expert_files", checkpoint_format_version=None)
        entry.update(ep_group_name=f"ep_size_{ep}", ep_rank=ep_rank, expert_data_parallel_rank=edp_rank,
                     expert_data_parallel_world_size=world // ep, global_expert_start=ep_rank * per,
                     global_expert_end=(ep_rank + 1) * per)
        out.append(entry)
    return out


def partition_groups(plan: Any, rank: int) -> list[dict[str, Any]]:
    """``ds_zero_partition_groups`` of a ZeRO-3 optimizer file (stage3.py ``_zero3_partition_group_metadata``, which
    the loader compares for equality with the live engine's): per sub-group its partition count, this rank's index,
    the partitioning ranks, placement families and group names."""
    target = _target(plan)
    topo = ParallelLayout(plan.world_size, ep=target.ep_size)
    experts = set(target.expert_param_names)
    out = []
    for s, shapes in enumerate(plan.param_shapes):
        if any(n in experts for n, _ in shapes):
            ranks = topo.expert_data_parallel_ranks(topo.expert_parallel_rank(rank))
            fam, names = ["autoep_expert"], [f"ep_size_{target.ep_size}"]
        else:
            ranks, fam, names = list(range(plan.world_size)), ["replicated"], ["replicated"]
        out.append({"sub_group": s, "partition_count": len(ranks), "partition_rank": ranks.index(rank),
                    "partition_ranks": ranks, "families": fam, "group_names": names})
    return out


def _target(plan: Any) -> AutoEpLayout:
    """The AutoEP layout a plan writes (its :attr:`~dsckpt.parallel_layout.ParallelTarget.experts`)."""
    target = plan.parallel.experts
    assert isinstance(target, AutoEpLayout), "an AutoEP plan"
    return target


def _affine_map(cut: ParamCut) -> dict[str, Any]:
    """``autoep_placement_to_affine_map(...).to_dict()`` for a contiguous placement: per EP rank one piece, its
    experts' rows of the row-major full tensor."""
    full = cut.full_shape
    strides = [math.prod(full[i + 1:]) for i in range(len(full))]
    ranks = {}
    for r, local in enumerate(cut.rank_shapes):
        (b,) = cut.rank_blocks(r)
        ranks[r] = {"shard_shape": list(local),
                    "pieces": [{"shape": list(local), "source": [b.full_offset, list(strides)],
                                "dest": [0, list(strides)], "locations": [r]}]}
    return {"logical_shape": list(full), "ranks": ranks}


def retarget_tree(name: str, tree: Mapping[str, Any], plan: Any) -> dict[str, Any]:
    """A target file's tree with the AutoEP facts that depend on the expert-parallel and world size rewritten: the
    model states' record (and its copy in ``universal_checkpoint_info``), the expert group's name in the optimizer
    state, ZeRO-3's partition groups, and ``expert_parallel.autoep_size`` in every saved config."""
    import re

    from .common import OSD

    target = _target(plan)
    m = re.match(r"^(?:bf16_)?zero_pp_rank_(\d+)_", name)
    rank = int(m[1]) if m else 0
    zero3 = plan.zero_stage == 3
    out = dict(tree)
    if "ds_autoep_layers" in out:
        out["ds_autoep_layers"] = retarget_record(out["ds_autoep_layers"], target, plan.world_size, rank, zero3)
        uci = out.get("universal_checkpoint_info")
        if isinstance(uci, Mapping) and "ds_autoep_layers" in uci:
            out["universal_checkpoint_info"] = {**uci, "ds_autoep_layers": out["ds_autoep_layers"]}
    if isinstance(out.get("ds_config"), Mapping):
        cfg = dict(out["ds_config"])
        if isinstance(cfg.get("expert_parallel"), Mapping):
            cfg["expert_parallel"] = {**cfg["expert_parallel"], "autoep_size": target.ep_size}
        out["ds_config"] = cfg
    osd = out.get(OSD)
    if isinstance(osd, Mapping):
        osd = dict(osd)
        inner_key = OSD if zero3 else "base_optimizer_state"
        base = osd.get(inner_key)
        if isinstance(base, Mapping) and isinstance(base.get("param_groups"), list):
            groups = [({**pg, "name": f"ep_size_{target.ep_size}"} if isinstance(pg, Mapping) and pg.get("moe")
                       else pg) for pg in base["param_groups"]]
            osd[inner_key] = {**base, "param_groups": groups}
        if zero3 and "fp32_flat_groups" in osd:
            # stage3.py _rigid_state_dict's key order: ... partition_count, ds_zero_partition_groups,
            # optimizer_state_dict
            groups = partition_groups(plan, rank)
            osd = {k: v for k, v in osd.items() if k != "ds_zero_partition_groups"}
            keys = list(osd)
            at = keys.index("partition_count") + 1 if "partition_count" in keys else len(keys)
            osd = {**{k: osd[k] for k in keys[:at]}, "ds_zero_partition_groups": groups,
                   **{k: osd[k] for k in keys[at:]}}
        out[OSD] = osd
    return out


def expert_file_trees(plan: Any, ckpt: LogicalCheckpoint, cache: Any) -> list[tuple[str, dict[str, Any]]]:
    """The ``layer_{L}_expert_{X}_mp_rank_00_model_states.pt`` files of a ZeRO-1/2 target written from a ZeRO-3
    AutoEP source, which has none (engine.py ``_save_moe_checkpoint``: per layer and global expert, its slice of every
    stacked expert param under ``<param>.X``, in the module's dtype): each slice cast from the fp32 master. The
    stacked master is read once per param (torch; the 16-bit cast needs it), one layer's worth in memory."""
    import torch

    from ..assemble import read_piece
    from ..model import Precision, Role

    target = _target(plan)
    # the module's dtype: the source's precision, handed down on the plan (the writer does not ask the checkpoint)
    dtype = {Precision.BF16: torch.bfloat16, Precision.FP16: torch.float16}.get(plan.precision, torch.float32)
    by_name = {e.name: e for e in ckpt.entries}
    out = []
    for layer in target.layers:
        full = {}
        for name in layer.param_names:
            master = by_name[name].piece(Role.MASTER)
            if master is None:
                raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': expert param '{name}' has no fp32 master")
            full[name] = read_piece(master, by_name[name].shape, cache, name=name).to(dtype)
        for x in range(layer.num_experts):
            out.append((f"layer_{layer.layer_id}_expert_{x}_mp_rank_00_model_states.pt",
                        {f"{name}.{x}": full[name][x].clone() for name in layer.param_names}))
    return out
