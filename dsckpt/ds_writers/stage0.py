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

__all__ = ["plan_stage0", "plan_stage0_from_zero", "stage0_as_zero_source", "stage0_model_trees",
           "stage0_tree_from_zero"]


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
            where = (e.state_piece("exp_avg") if ckpt.optimizer_wrapper == "torch optimizer" else master) or master
            f = where.fragments[0]
            key = tuple((0, k, "") if isinstance(k, int) else (1, 0, str(k)) for k in f.key)
            members.setdefault(e.group if e.group is not None else 0, []).append(((*key, f.src_offset), e.name))
        entries.append(e)
    orders = [[n for _, n in sorted(members[g], key=lambda m: m[0])] for g in sorted(members)]
    return dataclasses.replace(ckpt, entries=tuple(entries)), orders


def plan_stage0_from_zero(ckpt: LogicalCheckpoint, orders: list[list[str]], common: Mapping[str, Any]) -> LayoutPlan:
    """ZeRO-1/2/3 -> stage 0: one ``mp_rank_00_model_states.pt`` holding the full module and the optimizer state
    DeepSpeed 0.19.8's stage-0 engine loads (engine.py ``_load_checkpoint``: ``optimizer.load_state_dict``):

    * fp32: a plain torch optimizer state dict. Its indices count ``model.parameters()`` in module order, frozen
      params included (they hold no state), as the engine builds the optimizer from the params it is given; so
      one param group only, and the run must pass ``model.parameters()`` (torch refuses a group of another size);
    * bf16 with ``torch_adam``: ``FP16_UnfusedOptimizer``'s (fp16/unfused_optimizer.py ``state_dict``): per group
      its trainable params' fp32 masters (``fp32_groups``), the inner state indexed over them, a static scale.

    Refused (not written yet): fp16 (its dynamic loss scaler), and bf16 without ``torch_adam`` (the fused
    ``FP16_Optimizer`` with ``fp32_groups_flat``)."""
    cfg = ckpt.ds_config or {}
    opt_params = ((cfg.get("optimizer") or {}).get("params") or {}) if isinstance(cfg.get("optimizer"), Mapping) else {}
    why = None
    if ckpt.precision is Precision.FP16:
        why = "an fp16 target (its dynamic loss scaler in FP16_Optimizer's fields) is not written yet"
    elif ckpt.precision is Precision.BF16 and not opt_params.get("torch_adam"):
        why = ("a bf16 stage-0 run without torch_adam uses the fused FP16_Optimizer (fp32_groups_flat), which is not "
               "written yet; with \"torch_adam\": true in the optimizer params it is FP16_UnfusedOptimizer, which is")
    elif ckpt.precision is Precision.FP32 and len(orders) != 1:
        why = (f"{len(orders)} param groups: at fp32 the stage-0 optimizer numbers every param it is given, frozen "
               "ones too, and the files do not say which group a frozen param was given to")
    elif ckpt.moe is not None or ckpt.autoep is not None:
        why = "Mixture-of-Experts layouts are not converted to stage 0"
    if why is not None:
        raise UnsupportedCheckpointError(f"cannot convert '{ckpt.tag_dir}' from ZeRO stage {ckpt.zero_stage} to "
                                         f"stage 0: {why}; write it as ZeRO-1 instead (--zero-stage 1: the full "
                                         "module on every rank, as at stage 0)")
    by_name = {e.name: e for e in ckpt.entries}
    shapes = tuple(tuple((n, by_name[n].shape) for n in names) for names in orders)
    wrapper = "torch optimizer" if ckpt.precision is Precision.FP32 else "FP16_UnfusedOptimizer"  # as readers name it
    return LayoutPlan(**{**common, "optimizer_wrapper": wrapper}, param_shapes=shapes, subgroup_to_group=(),
                      alignment_paddings=(), ranks=(),
                      notes=("stage 0: the full module and the optimizer state in mp_rank_00_model_states.pt"
                             + ("; pass model.parameters() to deepspeed.initialize (the stage-0 optimizer numbers "
                                "frozen params too)" if ckpt.precision is Precision.FP32 else ""),))


def stage0_tree_from_zero(plan: LayoutPlan, ckpt: LogicalCheckpoint, scalars: Any, cache: Any) -> dict[str, Any]:
    """The ``mp_rank_00_model_states.pt`` tree of :func:`plan_stage0_from_zero`'s plan."""
    from .common import own_copy, streamed, target_ds_config
    from .plan import FlatSpec, range_copies
    from .zero12 import full_module

    src = dict(cache.tree(plan.source_model_files[0]))
    module = src["module"] if plan.from_stage in (1, 2) else full_module(ckpt, src["module"], cache)
    by_name = {e.name: e for e in ckpt.entries}

    def whole(name: str, role: Role, key: str | None = None) -> Any:
        e = by_name[name]
        piece = e.piece(role) if key is None else e.state_piece(key)
        if piece is None:
            raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': param '{name}' has no {key or role.value} values")
        return streamed(FlatSpec(e.numel, "float32", range_copies(piece, 0, e.numel, 0, name)), cache, shape=e.shape)

    def state(name: str) -> dict[str, Any]:
        return {"step": own_copy(scalars.step),
                **{k: whole(name, Role.OPTIM_STATE, k) for k in by_name[name].state_keys}}

    orders = [[n for n, _ in group] for group in plan.param_shapes]
    optimizer: dict[str, Any]
    if ckpt.precision is Precision.FP32:
        params = [e.name for e in ckpt.entries if e.kind is Kind.PARAM and e.tied_to is None]
        trained = set(orders[0])
        optimizer = {"state": {i: state(n) for i, n in enumerate(params) if n in trained},
                     "param_groups": [{**scalars.param_groups[0], "params": list(range(len(params)))}]}
    else:
        k = 0
        inner_state: dict[int, Any] = {}
        groups = []
        for g, names in enumerate(orders):
            groups.append({**scalars.param_groups[g], "params": list(range(k, k + len(names)))})
            for n in names:
                inner_state[k] = state(n)
                k += 1
        optimizer = {"dynamic_loss_scale": False, "cur_scale": 1.0, "cur_iter": ckpt.global_steps or 0,
                     "optimizer_state_dict": {"state": inner_state, "param_groups": groups},
                     "fp32_groups": [[whole(n, Role.MASTER) for n in names] for names in orders]}
    src.update(module=module, optimizer=optimizer, param_shapes=None, frozen_param_shapes=None,
               frozen_param_fragments=None, shared_params=None, dp_world_size=plan.world_size,
               ds_config=target_ds_config(src.get("ds_config"), 0, None))
    return src
