"""Stage-0 writer (no ZeRO; the mirror of :mod:`dsckpt.readers.stage0`): nothing is partitioned, the
whole module and optimizer live in ``mp_rank_00_model_states.pt``; only the recorded
``dp_world_size`` (the resume guard, engine.py:4744-4753) depends on the world size."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from ..errors import UnsupportedCheckpointError
from ..model import Kind, LogicalCheckpoint, Piece, Precision, Role
from .autoep import autoep_stage0_refusal
from .moe import at_expert_cut, expp_rank_orders, moe_stage0_refusal, stage0_expp_files, stage0_kept_files
from .plan import LayoutPlan, ModuleSource

__all__ = ["PIPELINE_NOTE", "STAGE0_BF16_PIPELINE_NOTE", "plan_stage0", "plan_stage0_from_zero",
           "stage0_as_zero_source", "stage0_model_trees", "stage0_refusal",
           "stage0_trees_from_zero", "stage0_wrapper", "stage0_wrapper_refusal", "STAGE0_TORCH_OPTIMIZER"]

#: :func:`stage0_wrapper`'s answer at fp32: no wrapper, the torch optimizer's own state dict (the readers' name)
STAGE0_TORCH_OPTIMIZER = "torch optimizer"


def plan_stage0(ckpt: LogicalCheckpoint, common: Mapping[str, Any]) -> LayoutPlan:
    models = tuple(p for p in ckpt.files if p.name.startswith("mp_rank_") and p.name.endswith("_model_states.pt"))
    notes = ["stage 0: nothing is partitioned; only the recorded dp_world_size changes"]
    copied, moe_notes = stage0_kept_files(ckpt, common["world_size"])  # native MoE's expert and expp_rank_* files
    notes += moe_notes
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

    fp16: the loss scale the wrapper keeps in its own fields becomes ZeRO's ``DynamicLossScaler``
    (:func:`~.common.stage0_scalars`). MoE (fp32, ``expp_rank_*`` files): an expert group's order is expert-parallel
    rank 0's, under the local names ZeRO's ``param_shapes`` list (its experts' global names are those); the other
    ranks' experts follow from the rank arithmetic (:func:`~.moe.rank_in_group`), each group in module order."""
    import dataclasses

    from .moe import expert_group_ids, held_by_ep_rank_0

    expert_groups = expert_group_ids(ckpt)
    position = {e.name: i for i, e in enumerate(ckpt.entries)}
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
            group = e.group if e.group is not None else 0
            if group not in expert_groups:
                members.setdefault(group, []).append(((*key, f.src_offset), e.name))
            elif held_by_ep_rank_0(ckpt, e.name):
                # module order, as model.parameters() hands the experts to
                # split_params_into_different_moe_groups_for_optimizer: at another expert-parallel size rank 0's
                # experts come from several source expp_rank files, whose per-file positions would interleave them
                members.setdefault(group, []).append((((0, position[e.name], ""),), e.name))
        entries.append(e)
    orders = [[n for _, n in sorted(members[g], key=lambda m: m[0])] for g in sorted(members)]
    return dataclasses.replace(ckpt, entries=tuple(entries)), orders


def stage0_wrapper(ckpt: LogicalCheckpoint) -> str:
    """The wrapper DeepSpeed 0.19.8's stage-0 engine puts around the optimizer of ``ckpt``'s run, as the readers name
    it: none at fp32 (``"torch optimizer"``); at fp16/bf16 ``FP16_Optimizer`` when the inner optimizer is
    ``FusedAdam`` (engine.py ``_configure_fp16_optimizer``: ``isinstance(optimizer, FusedAdam)``), which DeepSpeed
    builds for ``"type": "Adam"``/``"AdamW"`` unless ``torch_adam`` (``_configure_basic_optimizer``; a ZeRO-Offload
    run's DeepSpeedCPUAdam is FusedAdam too once there is no ZeRO to offload with), else ``FP16_UnfusedOptimizer``.
    Without an ``optimizer`` section (a client optimizer) the param groups tell: FusedAdam's hold ``bias_correction``
    and no ``foreach``, torch's ``foreach``."""
    why = stage0_wrapper_refusal(ckpt)  # a row of .target.RULES (stage0_refusal): refused before any writer plans
    if why is not None:
        raise UnsupportedCheckpointError(why)
    return _stage0_wrapper(ckpt) or ""


def stage0_wrapper_refusal(ckpt: LogicalCheckpoint) -> str | None:
    """Why :func:`stage0_wrapper` cannot tell the wrapper of ``ckpt``'s stage-0 run (None: it can)."""
    if _stage0_wrapper(ckpt) is not None:
        return None
    return (f"cannot convert '{ckpt.tag_dir}' to stage 0: its ds_config names no optimizer and its param groups do "
            "not say whether it was DeepSpeed's FusedAdam (stage 0 then uses FP16_Optimizer) or another optimizer "
            "(FP16_UnfusedOptimizer); write it as ZeRO-1 instead (--zero-stage 1: the full module on every rank)")


def _stage0_wrapper(ckpt: LogicalCheckpoint) -> str | None:
    if ckpt.precision is Precision.FP32:
        return STAGE0_TORCH_OPTIMIZER
    cfg = ckpt.ds_config or {}
    opt = cfg.get("optimizer") if isinstance(cfg, Mapping) else None
    if isinstance(opt, Mapping) and opt.get("type") is not None:
        params: Mapping[str, Any] = opt["params"] if isinstance(opt.get("params"), Mapping) else {}
        fused = str(opt["type"]).lower() in ("adam", "adamw") and not params.get("torch_adam", False)
        return "FP16_Optimizer" if fused else "FP16_UnfusedOptimizer"
    keys = {k for g in ckpt.optimizer_groups for k, _ in g.hyperparams}
    if "foreach" in keys:
        return "FP16_UnfusedOptimizer"
    if "bias_correction" in keys:
        return "FP16_Optimizer"
    return None


def stage0_refusal(ckpt: LogicalCheckpoint, orders: list[list[str]], world: int) -> str | None:
    """Why ``ckpt`` (one model-parallel rank's view, its optimizer groups' ``orders``:
    :func:`dsckpt.ds_writers.source_group_orders`) cannot be rebuilt as stage 0 on ``world`` data-parallel ranks
    (:func:`plan_stage0_from_zero`), None where it can: at fp32 several param groups and frozen params; AutoEP; native
    MoE of several expert-parallel sizes, or one that does not divide ``world``; a 16-bit run whose wrapper the files
    do not tell (:func:`stage0_wrapper`). In that order: the first that applies."""
    from .moe import moe_world_refusal

    frozen = [e.name for e in ckpt.entries if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None]
    if ckpt.precision is Precision.FP32 and len(orders) != 1 and frozen:
        why: str | None = (
            f"{len(orders)} param groups and frozen params ({', '.join(frozen[:3])}): at fp32 the stage-0 optimizer "
            "numbers every param it is given, frozen ones too, and the files do not say which group a frozen param "
            "was given to")
    else:
        why = autoep_stage0_refusal(ckpt) or moe_stage0_refusal(ckpt)
    if why is not None:
        return (f"cannot convert '{ckpt.tag_dir}' from ZeRO stage {ckpt.zero_stage} to stage 0: {why}; write it as "
                "ZeRO-1 instead (--zero-stage 1: the full module on every rank, as at stage 0)")
    return moe_world_refusal(ckpt, world) or stage0_wrapper_refusal(ckpt)


def plan_stage0_from_zero(ckpt: LogicalCheckpoint, orders: list[list[str]], common: Mapping[str, Any]) -> LayoutPlan:
    """ZeRO-1/2/3 -> stage 0: one ``mp_rank_00_model_states.pt`` holding the full module and the optimizer state
    DeepSpeed 0.19.8's stage-0 engine loads (engine.py ``_load_checkpoint``: ``optimizer.load_state_dict``), for the
    wrapper :func:`stage0_wrapper` names:

    * fp32: a plain torch optimizer state dict. Its indices count ``model.parameters()`` in module order, frozen
      params included (they hold no state), as the engine builds the optimizer from the params it is given; so
      one param group only, and the run must pass ``model.parameters()`` (torch refuses a group of another size);
    * ``FP16_UnfusedOptimizer`` (fp16/unfused_optimizer.py ``state_dict``): per group its trainable params' fp32
      masters (``fp32_groups``), the inner state indexed over them;
    * ``FP16_Optimizer`` (fp16/fused_optimizer.py ``state_dict``): per group one flat fp32 master
      (``fp32_groups_flat``, the group's params in order, unpadded), the inner state per group, ``clip_grad``; the
      module's params of a group are views into one 16-bit flat buffer at the same offsets, as DeepSpeed saves them;
    * fp16: the loss scale as those wrappers keep it (``cur_scale``, ``cur_iter`` and, dynamic, ``last_overflow_iter``,
      ``scale_factor``, ``scale_window``; :func:`~.common.stage0_scale_fields`). They have no hysteresis: the ZeRO
      scaler's ``cur_hysteresis`` has nowhere to go (a stage-0 run lowers the scale at the first overflow)."""
    # what cannot be written was refused in phase 2 (.target.RULES: _stage0_rebuilt); a guard here
    why = stage0_refusal(ckpt, orders, common["world_size"])
    if why is not None:
        raise UnsupportedCheckpointError(why)
    by_name = {e.name: e for e in ckpt.entries}
    shapes = tuple(tuple((n, by_name[n].shape) for n in names) for names in orders)
    wrapper = stage0_wrapper(ckpt)
    if common["pipeline_stage"]:  # one stage of a pipeline (ds_writers.retarget.rank_view): its trainable params only
        notes = [PIPELINE_NOTE]
    else:
        notes = ["stage 0: the full module and the optimizer state in mp_rank_00_model_states.pt"
                 + (" (each TP rank's slices in its own mp_rank_XX file)" if common["parallel"].tp_size > 1 else "")
                 + ("; pass model.parameters() to deepspeed.initialize (the stage-0 optimizer numbers frozen params "
                    "too)" if ckpt.precision is Precision.FP32 and len(orders) == 1 else "")]
    copied, moe_notes = stage0_expp_files(ckpt, tuple(common.get("copied_model_files", ())))
    notes += moe_notes
    return LayoutPlan(**{**common, "optimizer_wrapper": wrapper, "copied_model_files": copied}, param_shapes=shapes,
                      subgroup_to_group=(), alignment_paddings=(), ranks=(), notes=tuple(notes))


#: A bf16 pipeline run without ZeRO trains under BF16_Optimizer (engine.py ``_configure_optimizer``: bf16 +
#: pipeline), whose state is the same as at ZeRO-1 with fp32 gradient accumulation; DeepSpeed 0.19.8 cannot resume the
#: stage-0 form, not even unchanged (``_load_checkpoint`` hands the model states' ``optimizer`` dict to
#: ``BF16_Optimizer._load_legacy_checkpoint``, which indexes it by data-parallel rank: ``KeyError: 0``).
STAGE0_BF16_PIPELINE_NOTE = (
    "ZeRO stage 0 bf16 pipeline (BF16_Optimizer) written as ZeRO-1 BF16_Optimizer files, the same optimizer and state: "
    "DeepSpeed 0.19.8 cannot resume the stage-0 form (KeyError in BF16_Optimizer._load_legacy_checkpoint); resume "
    'with "zero_optimization": {"stage": 1} and "data_types": {"grad_accum_dtype": "fp32"}')


#: The stage-0 files of a pipeline stage (an fp32 ZeRO-1 pipeline written without ZeRO): DeepSpeed 0.19.8's
#: PipelineEngine at stage 0 trains each stage's params under a plain torch optimizer and saves its ``state_dict()`` in
#: ``mp_rank_{stage:02d}_model_states.pt``, numbered over the params it was given (pp2_fp32_z0: a stage's params that
#: require grad in ``parameters()`` order, its tied modules first), and ``param_shapes`` None. Here ``param_shapes``
#: names them (DeepSpeed's stage-0 loader does not read it), so the files say what DeepSpeed's own do not.
PIPELINE_NOTE = ("stage 0 pipeline: each stage's torch optimizer state in mp_rank_XX_model_states.pt over the stage's "
                 "params that require grad, in module order (tied modules first): pass [p for p in "
                 "model.parameters() if p.requires_grad] to deepspeed.initialize; param_shapes names them")


def stage0_trees_from_zero(plan: LayoutPlan, ckpt: LogicalCheckpoint, scalars: Any,
                           cache: Any) -> list[tuple[str, dict[str, Any]]]:
    """The files of :func:`plan_stage0_from_zero`'s plan besides the copied ones: ``mp_rank_00_model_states.pt``,
    and for native MoE one ``expp_rank_{R}_mp_rank_00_optim_states.pt`` per expert-parallel rank ``R``
    (engine.py ``_save_moe_checkpoint``: ``{"optimizer": optimizer.state_dict()}`` of that rank, whose expert groups
    hold its experts under local names -- a torch optimizer's at fp32, ``FP16_UnfusedOptimizer``'s or
    ``FP16_Optimizer``'s at 16 bits, the dense masters repeated in every file; ``mp_rank_00`` carries expert-parallel
    rank 0's, as DeepSpeed's rank 0 saves its own)."""

    from .common import own_copy, shapes_tree, stage0_scale_fields, streamed, target_ds_config
    from .plan import FlatSpec, range_copies
    from .zero12 import full_module, module_from_copies

    ckpt = at_expert_cut(ckpt, plan.parallel)  # native MoE at --ep-size: the new expert cut
    src = dict(cache.tree(plan.source_model_files[0]))
    module: Mapping[str, Any]
    if plan.module_source is ModuleSource.MASTERS_CAST:
        module = full_module(ckpt, src["module"], cache)
    elif plan.tp_size != plan.source_tp_size and src["module"] is not None:  # another TP cut: the slices re-cut too
        module = module_from_copies(ckpt, src["module"], cache)
    else:
        module = src["module"]
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

    def torch_state_dict(groups: list[list[str]], trained: set[str]) -> dict[str, Any]:
        """A torch optimizer's state dict over ``groups`` of params (numbered across groups, as torch does); a
        state for the ``trained`` ones."""
        k, out_state, out_groups = 0, {}, []
        for g, names in enumerate(groups):
            out_groups.append({**scalars.param_groups[g], "params": list(range(k, k + len(names)))})
            for n in names:
                if n in trained:
                    out_state[k] = state(n)
                k += 1
        return {"state": out_state, "param_groups": out_groups}

    orders = [[n for n, _ in group] for group in plan.param_shapes]
    optimizer: dict[str, Any]
    # the planner's choices (plan_stage0_from_zero): the wrapper (stage0_wrapper: a torch optimizer at fp32), and the
    # source's precision handed down on the plan (which of them scales the loss)
    torch_optimizer = plan.optimizer_wrapper == STAGE0_TORCH_OPTIMIZER
    fp16 = plan.precision is Precision.FP16
    scale = stage0_scale_fields(scalars.loss_scaler, fp16=fp16, cur_iter=ckpt.global_steps or 0)
    expp: list[tuple[str, dict[str, Any]]] = []
    ep_rank_orders = expp_rank_orders(ckpt, orders)  # native MoE: per expert-parallel rank, its optimizer's groups
    if ep_rank_orders is not None:  # fp32: a torch optimizer's state dict; 16-bit: FP16_UnfusedOptimizer's (plan)
        for r, groups in enumerate(ep_rank_orders):
            if plan.optimizer_wrapper == "FP16_Optimizer":
                # the module stays as saved: a MoE save clones every tensor, no view into the flat buffers
                fused, _ = _fused_optimizer(plan, ckpt, scalars, module, groups, cache)
                optimizer = {**(scale if fp16 else {}), **fused}
            else:
                optimizer = torch_state_dict(groups, {n for names in groups for n in names})
                if not torch_optimizer:  # FP16_UnfusedOptimizer's
                    optimizer = {**scale, "optimizer_state_dict": optimizer,
                                 "fp32_groups": [[whole(n, Role.MASTER) for n in names] for names in groups]}
            expp.append((f"expp_rank_{r}_mp_rank_00_optim_states.pt", {"optimizer": optimizer}))
        optimizer = expp[0][1]["optimizer"]
    elif torch_optimizer and plan.pipeline_stage:  # the stage's trainable params (PIPELINE_NOTE)
        optimizer = torch_state_dict(orders, {n for names in orders for n in names})
    elif torch_optimizer and len(orders) == 1:
        # one group: every param the engine was given (model.parameters(), frozen ones too) in module order
        params = [e.name for e in ckpt.entries if e.kind is Kind.PARAM and e.tied_to is None]
        optimizer = torch_state_dict([params], set(orders[0]))
    elif torch_optimizer:  # several groups and no frozen param (plan_stage0_from_zero)
        optimizer = torch_state_dict(orders, {n for names in orders for n in names})
    elif plan.optimizer_wrapper == "FP16_Optimizer":
        optimizer, module = _fused_optimizer(plan, ckpt, scalars, module, orders, cache)
        # FP16_Optimizer.state_dict saves the scale only where it scales (LossScaleConfig.use_grad_scaling: fp16)
        optimizer = {**(scale if fp16 else {}), **optimizer}
    else:
        inner = torch_state_dict(orders, {n for names in orders for n in names})
        optimizer = {**scale, "optimizer_state_dict": inner,
                     "fp32_groups": [[whole(n, Role.MASTER) for n in names] for names in orders]}
    src.update(module=module, optimizer=optimizer, param_shapes=None, frozen_param_shapes=None,
               frozen_param_fragments=None, shared_params=None, dp_world_size=plan.world_size,
               ds_config=target_ds_config(src.get("ds_config"), 0, None))
    if plan.pipeline_stage:
        src["param_shapes"] = shapes_tree(plan)  # names the optimizer's params (PIPELINE_NOTE)
    return [(f"mp_rank_{plan.mp_rank:02d}_model_states.pt", src), *expp]


def _fused_optimizer(plan: LayoutPlan, ckpt: LogicalCheckpoint, scalars: Any, module: Mapping[str, Any],
                     orders: list[list[str]], cache: Any) -> tuple[dict[str, Any], dict[str, Any]]:
    """``FP16_Optimizer``'s state dict (without the loss-scale fields) and the module to save beside it.

    Per group ``g``: ``fp32_groups_flat[g]`` and the inner (FusedAdam) state ``g`` hold the group's params one after
    the other, unpadded (``_flatten_dense_tensors``, fused_optimizer.py:89-103); the state keeps the source's scalars
    (FusedAdam's int ``step``) as saved. The module's params of group ``g`` become views into one new 16-bit flat
    buffer laid out the same way, as DeepSpeed's saved module is (its tensors are views into ``fp16_groups_flat``):
    from each param's 16-bit copy, or, from a ZeRO-3 source, the module :func:`~.zero12.full_module` cast from the
    masters. ``clip_grad``: the source's, else (ZeRO-3 files store none) the recorded ``gradient_clipping`` or
    DeepSpeed's default 1.0 -- ``FP16_Optimizer.load_state_dict`` requires it and adopts it."""
    from ..writers.torch_stream import TensorView, dtype_name
    from .common import group_state_tree, streamed
    from .plan import FlatSpec, OptimizerCopies, coalesce, range_copies

    by_name = {e.name: e for e in ckpt.entries}
    out = dict(module)
    flats, inner_state, groups = [], {}, []
    lowp = "float16" if plan.precision is Precision.FP16 else "bfloat16"
    for g, names in enumerate(orders):
        entries = [by_name[n] for n in names]
        copies = OptimizerCopies(ckpt, entries)
        offsets, total = [], 0
        for e in entries:
            copies.add(e.name, e, 0, e.numel, total)
            offsets.append(total)
            total += e.numel
        flats.append(streamed(copies.master_spec(total), cache))
        specs = dict(copies.state_specs(total))
        inner_state[g] = group_state_tree(scalars.group_states[g] if g < len(scalars.group_states) else {}, specs,
                                          cache)
        groups.append({**scalars.param_groups[g], "params": [g]})
        base: Any
        if plan.module_source is ModuleSource.MASTERS_CAST:  # the 16-bit params: only the masters cast (full_module),
            # one flat tensor
            import torch

            base = torch.cat([module[n].reshape(-1) for n in names]) if names else torch.empty(0)
            if dtype_name(base) != lowp:
                base = base.to(getattr(torch, lowp))
        else:
            lowp_copies: list[Any] = []
            for e, off in zip(entries, offsets):
                piece = e.piece(Role.MODULE)
                if piece is None:
                    raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': param '{e.name}' has no 16-bit module copy")
                lowp_copies.extend(range_copies(piece, 0, e.numel, off, e.name))
            base = streamed(FlatSpec(total, lowp, coalesce(lowp_copies)), cache)
        for e, off in zip(entries, offsets):
            out[e.name] = TensorView(base, off, tuple(e.shape))
    for name in list(out):  # tied aliases: the very view of their source, as state_dict() gives them
        alias = by_name.get(name)
        if alias is not None and alias.tied_to is not None and alias.tied_to in out:
            out[name] = out[alias.tied_to]
    clip = scalars.clip_grad
    if clip is None:
        cfg = ckpt.ds_config if isinstance(ckpt.ds_config, Mapping) else {}
        clip = cfg.get("gradient_clipping", 1.0)
    optimizer = {"optimizer_state_dict": {"state": inner_state, "param_groups": groups}, "fp32_groups_flat": flats,
                 "clip_grad": clip}
    return optimizer, out
