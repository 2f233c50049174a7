"""What a plan needs to know about its source beyond the logical model, and what cannot be planned.

:func:`read_source_facts` reads the few layout facts the writers plan with (flat order from
``param_shapes``, stage-3 sub-groups and ``ds_id`` s, round robin, parameter alignment) from the
source's rank-0 files -- pickles only, no tensor bytes -- and refuses up front, in one message, what
no writer can reproduce (tensor/pipeline parallel sizes, optimizer state that is not one value per
element -- 1-bit Adam/Lamb error feedback, factored second moments --, Adagrad at ZeRO-3, AutoEP
partition groups); :func:`refuse_elastic_target` refuses every target of an ``elastic_checkpoint`` save but its own
layout. Every optimizer whose state is per element is rewritten, whatever its keys; each group keeps its own
``step`` and hyper-parameters. :func:`derive_facts` recovers the same facts from the logical model alone (pure;
used by tests and dry runs without a cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import OSD
from ..model import Kind, LogicalCheckpoint, Role, TensorEntry
from ..partition import DEFAULT_SUB_GROUP_SIZE
from ..readers.zero3 import zero3_ds_ids
from .moe import held_by_ep_rank_0
from .plan import SourceFacts, source_layout_stage

__all__ = ["ELASTIC_NOTE", "derive_facts", "elastic_target_refusal", "entries_by_name", "is_elastic",
           "read_source_facts", "refuse_elastic_target", "refusal_message", "refusals_from_logical"]

# ds_config optimizer types whose state holds buffers sized by the world size (1-bit error feedback)
ONE_BIT_OPTIMIZERS = frozenset({"onebitadam", "zerooneadam", "onebitlamb"})


def read_source_facts(ckpt: LogicalCheckpoint, cache: Any) -> SourceFacts:
    """Read the layout facts :func:`plan_reshard` needs and refuse what cannot be resharded.

    Every problem found is reported in one :class:`UnsupportedCheckpointError`.
    """
    from ..layout import classify_files

    problems = refusals_from_logical(ckpt)
    if problems:
        raise UnsupportedCheckpointError(refusal_message(ckpt, problems))
    ckpt.require_unambiguous("reshard", moments=True)
    files = classify_files(ckpt.root, ckpt.tag, ckpt.tag_dir)
    cfg = ckpt.ds_config or {}
    z = cfg.get("zero_optimization")
    zcfg: Mapping[str, Any] = z if isinstance(z, Mapping) else {}
    opt_type = (ckpt.optimizer_type or "").lower()
    if opt_type in ONE_BIT_OPTIMIZERS:
        problems.append(f"optimizer type '{ckpt.optimizer_type}' in ds_config: its error-feedback buffers "
                        "(worker_error, server_error) are sized by the world size, not one value per element, and "
                        "DeepSpeed itself resets them when the world size changes")
    if opt_type == "adagrad" and ckpt.zero_stage == 3:
        problems.append("Adagrad at ZeRO-3, whose checkpoints DeepSpeed 0.19.8 cannot resume, not even unchanged "
                        "(load_checkpoint of its own save fails: \"loaded state dict contains a parameter group that "
                        "doesn't match the size of optimizer's group\")")
    if any(g.hyperparam("use_muon") for g in ckpt.optimizer_groups) and ckpt.zero_stage == 3:
        problems.append("Muon at ZeRO-3 (dsckpt rewrites Muon's ZeRO-1/2 layout, whose momentum holds whole params)")

    if source_layout_stage(ckpt) == 0:
        if problems:
            raise UnsupportedCheckpointError(refusal_message(ckpt, problems))
        # a ZeRO-3 target's ds_ids: the module's own params in order (stage 0 records no shared_params)
        own = (e.name for e in ckpt.entries if e.kind is Kind.PARAM and e.tied_to is None)
        return SourceFacts((), (), param_ds_ids=tuple((n, i) for i, n in enumerate(own)))

    if ckpt.layout.startswith("universal"):
        if problems:
            raise UnsupportedCheckpointError(refusal_message(ckpt, problems))
        return _universal_facts(ckpt, zcfg, cache)
    optim_files = [files.dp_mp_to_optim_states[(d, 0)] for d in range(ckpt.dp_world_size)]
    osd0 = cache.tree(optim_files[0]).get(OSD) or {}
    if ckpt.zero_stage == 3:
        ms0 = cache.tree(files.dp_mp_to_zero3_model_states[(0, 0)])
        inner = osd0.get(OSD) or {}
        state = inner.get("state") or {}
        param_groups = inner.get("param_groups") or []
        if osd0.get("ds_zero_partition_groups") is not None and ckpt.autoep is None:
            problems.append("AutoEP expert partition groups ('ds_zero_partition_groups')")
    else:
        ms0 = cache.tree(files.mp_to_model_states[0])
        base = osd0.get("base_optimizer_state")
        if isinstance(base, list):
            if not is_elastic(ckpt):
                problems.append("an elastic-checkpoint optimizer state (a list of per-group states) although the "
                                "saved ds_config does not set zero_optimization.elastic_checkpoint")
            state = dict(enumerate(base))
            param_groups = []
        else:
            state = (base or {}).get("state") or {}
            param_groups = (base or {}).get("param_groups") or []
        counts = osd0.get("partition_count")
        if ckpt.moe is None and ckpt.autoep is None and isinstance(counts, list) and any(
                int(c) != ckpt.dp_world_size for c in counts):
            problems.append(f"partition_count {counts} (MoE expert groups partitioned over fewer ranks)")
    if ckpt.moe is None and ckpt.autoep is None and ms0.get("num_experts") is not None:
        problems.append("Mixture-of-Experts layers ('num_experts' in the model states)")
    if (ckpt.moe is not None or ckpt.autoep is not None) and bool(zcfg.get("round_robin_gradients", False)):
        problems.append("Mixture-of-Experts with round_robin_gradients")
    problems += non_element_states(ckpt, state)
    if problems:
        raise UnsupportedCheckpointError(refusal_message(ckpt, problems))

    param_shapes = ms0.get("param_shapes") or []
    flat_order = tuple(tuple(str(n) for n in shapes) for shapes in param_shapes)
    if ckpt.zero_stage == 3:
        sub_to_group = [-1] * len(flat_order)
        for g, pg in enumerate(param_groups):
            for s in pg.get("params", []):
                if isinstance(s, int) and 0 <= s < len(sub_to_group):
                    sub_to_group[s] = g
        if -1 in sub_to_group:
            raise CorruptCheckpointError(
                f"{optim_files[0]}: sub-group {sub_to_group.index(-1)} belongs to no optimizer param group")
        sub_group_size = zcfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
    else:
        sub_to_group = list(range(len(flat_order)))
        sub_group_size = None
    ds_ids = tuple(zero3_ds_ids(ms0).items())
    return SourceFacts(
        vocab_divisor=recorded_vocab_divisor(ms0),
        group_flat_order=flat_order,
        subgroup_to_group=tuple(sub_to_group),
        round_robin=bool(zcfg.get("round_robin_gradients", False)),
        parameter_alignment=bool(zcfg.get("parameter_alignment", False)),
        sub_group_size=int(sub_group_size) if sub_group_size is not None else None,
        param_ds_ids=ds_ids,
    )


def non_element_states(ckpt: LogicalCheckpoint, state: Mapping[Any, Any]) -> list[str]:
    """The optimizer states of rank 0 that hold more than one value yet not one per element of their flat group
    (nor are Muon's whole-param momentum): each refused by name, since no rewrite to another layout exists for
    them. Scalars (``step``, NAdam's ``mu_product``) are kept as saved."""
    from ..tensor_ref import TensorRef

    per_element = {k for e in ckpt.entries for k in e.state_keys}
    found: dict[str, tuple[int, ...]] = {}
    for st in state.values():
        if not isinstance(st, Mapping):
            continue
        for k, v in st.items():
            if isinstance(v, TensorRef) and v.numel > 1 and str(k) not in per_element:
                found.setdefault(str(k), tuple(v.shape))
    out = []
    for k, shape in found.items():
        why = ("a factored second moment (row/column statistics, as Adafactor keeps)" if k.endswith(("_row", "_col"))
               else "an error-feedback buffer sized by the world size (1-bit Adam/Lamb)" if "error" in k
               else "not one value per element of its param group")
        out.append(f"optimizer state '{k}' of shape {list(shape)}: {why}; it has no rewrite to another layout")
    return out


def _universal_facts(ckpt: LogicalCheckpoint, zcfg: Mapping[str, Any], cache: Any) -> SourceFacts:
    """The layout facts of a universal folder (``ds_to_universal``'s output): flat order and stage-3 sub-groups from
    the model-states files it copied, their optimizer param groups from ``zero/optimizer_state.pt``."""
    from ..layout import UNIVERSAL_DIR, UNIVERSAL_OPTIMIZER_STATE
    from .plan import source_model_files

    ms0 = cache.tree(source_model_files(ckpt)[0])
    opt = cache.tree(ckpt.tag_dir / UNIVERSAL_DIR / UNIVERSAL_OPTIMIZER_STATE)
    flat_order = tuple(tuple(str(n) for n in shapes) for shapes in ms0.get("param_shapes") or [])
    sub_to_group = list(range(len(flat_order)))
    if ckpt.zero_stage == 3:
        for g, pg in enumerate(opt.get("param_groups") or []):
            for sg in pg.get("params", []) if isinstance(pg, Mapping) else []:
                if isinstance(sg, int) and 0 <= sg < len(sub_to_group):
                    sub_to_group[sg] = g
    ds_ids = tuple(zero3_ds_ids(ms0).items())
    return SourceFacts(
        vocab_divisor=recorded_vocab_divisor(ms0),
        group_flat_order=flat_order, subgroup_to_group=tuple(sub_to_group),
        round_robin=bool(zcfg.get("round_robin_gradients", False)),
        parameter_alignment=bool(zcfg.get("parameter_alignment", False)),
        sub_group_size=int(zcfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)) if ckpt.zero_stage == 3 else None,
        param_ds_ids=ds_ids)


def refusals_from_logical(ckpt: LogicalCheckpoint) -> list[str]:
    problems = []
    if ckpt.tp_world_size > 1 and ckpt.tensor_parallel is None:
        problems.append(f"tensor parallel size {ckpt.tp_world_size} without a tensor-parallel record")
    if (ckpt.pp_world_size > 1 or ckpt.layout == "pipeline") and ckpt.pipeline is None:
        problems.append(f"pipeline parallel size {ckpt.pp_world_size}" + (
            f" x tensor parallel size {ckpt.tp_world_size}" if ckpt.tp_world_size > 1 else ""))
    if ckpt.pipeline is not None and source_layout_stage(ckpt) == 0 and ckpt.optimizer_wrapper != "torch optimizer":
        # "torch optimizer": its param_shapes name each stage's params (readers/pipeline.py), as dsckpt writes them
        problems.append("a pipeline run without ZeRO or BF16_Optimizer (its optimizer state sits in each stage's "
                        "mp_rank_XX_model_states.pt, which dsckpt does not read yet)")
    if ckpt.pipeline is not None and ckpt.pipeline.unkeyed_tied:
        # DeepSpeed's own fp32 stage-0 pipeline save (readers/pipeline_binding.py): the output names every param
        # (param_shapes, param_slice_mappings), and a universal checkpoint made from it is loaded by those names
        layers = ckpt.pipeline.unkeyed_tied
        problems.append(
            f"tied module(s) in {', '.join(f'layer_{i:02d}-model_states.pt' for i in layers)} whose TiedLayerSpec key "
            "no file states (DeepSpeed's own stage-0 pipeline save), which the output would have to name "
            f"(tied_modules.<key>.*); give it with {' '.join(f'--tied-key {i}=KEY' for i in layers)}, KEY as in "
            "the run's TiedLayerSpec(KEY, ...)")
    if ckpt.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {ckpt.zero_stage}")
    if ckpt.layout.startswith("universal") and (ckpt.tensor_parallel is not None or ckpt.autoep is not None):
        problems.append("a DeepSpeed universal checkpoint of a tensor-parallel or AutoEP run, which is written as "
                        "ZeRO files for data-parallel runs only; DeepSpeed loads it on any rank count with "
                        "load_universal")
    return problems


ELASTIC_NOTE = ("elastic_checkpoint: written as elastic files again (each group's state cut at the new partition "
                "boundaries, no param groups); base_optimizer_state_step, the groups' step, added where the source "
                "lacks it (DeepSpeed 0.19.8 saves it only for optimizers that keep a step in their param groups, not "
                "torch's Adam/AdamW, yet its elastic load asserts it)")


def is_elastic(ckpt: LogicalCheckpoint) -> bool:
    """Whether ``ckpt`` is a ZeRO-1/2 ``elastic_checkpoint`` save: DeepSpeed's ZeRO-1/2 optimizer under a ds_config
    with ``zero_optimization.elastic_checkpoint`` true, which makes it save a list of per-group states, each rank's
    tail padding stripped, and no param groups (stage_1_and_2.py state_dict; :func:`read_source_facts` checks that
    the files agree)."""
    z = (ckpt.ds_config or {}).get("zero_optimization")
    return (ckpt.layout in ("zero1", "zero2") and ckpt.optimizer_wrapper == "DeepSpeedZeroOptimizer"
            and isinstance(z, Mapping) and z.get("elastic_checkpoint") is True)


def refuse_elastic_target(ckpt: LogicalCheckpoint, *, zero_stage: int | None, tp_size: int | None = None,
                          ep_size: int | None = None, universal: bool = False) -> None:
    """Raise :func:`elastic_target_refusal`'s refusal, if any."""
    message = elastic_target_refusal(ckpt, zero_stage=zero_stage, tp_size=tp_size, ep_size=ep_size,
                                     universal=universal)
    if message is not None:
        raise UnsupportedCheckpointError(message)


def elastic_target_refusal(ckpt: LogicalCheckpoint, *, zero_stage: int | None, tp_size: int | None = None,
                           ep_size: int | None = None, universal: bool = False) -> str | None:
    """Refuse, by name and why, every target of an ``elastic_checkpoint`` source but its own layout: ZeRO-1/2
    elastic files (at any data-parallel size; the config keeps ``elastic_checkpoint``) are its one lossless rewrite.
    Every other layout stores the optimizer's param groups, which the elastic files do not keep. None: allowed."""
    if not is_elastic(ckpt):
        return None
    target = ("a universal checkpoint (--universal)" if universal
              else f"ZeRO stage {zero_stage}" if zero_stage not in (None, 1, 2)
              else f"tensor parallel size {tp_size}" if tp_size not in (None, 1)
              else f"expert-parallel size {ep_size}" if ep_size is not None else None)
    if target is None:
        return None
    return (
        f"cannot reshard '{ckpt.tag_dir}' (a ZeRO-{ckpt.zero_stage} zero_optimization.elastic_checkpoint save) to "
        f"{target}: its optimizer files keep each param group's state but not the param groups themselves "
        "(lr, betas, eps, weight_decay: DeepSpeed's elastic save leaves them out, and its load keeps those of the "
        f"resuming run's config), and {target} stores them, so dsckpt would have to invent them. Reshard it to "
        "ZeRO stage 1 or 2 instead: elastic files again, at any data-parallel size, which DeepSpeed loads with the "
        "run's config (elastic_checkpoint kept)")


def refusal_message(ckpt: LogicalCheckpoint, problems: list[str]) -> str:
    return (f"cannot reshard '{ckpt.tag_dir}': found " + "; ".join(problems)
            + ". dsckpt reshard rewrites data-parallel ZeRO 0-3 checkpoints of any optimizer whose state is one "
            "value per element (Adam, AdamW, SGD, Adagrad, Lion, Lamb, Muon, torch.optim classes)")



def entries_by_name(ckpt: LogicalCheckpoint) -> dict[str, TensorEntry]:
    return {e.name: e for e in ckpt.entries}


def derive_facts(ckpt: LogicalCheckpoint) -> SourceFacts:
    """Facts recoverable from the logical model alone (flat order from the fragment positions)."""
    groups: dict[int, list[tuple[int, int, str]]] = {}
    for e in ckpt.entries:
        if ckpt.moe is not None and not held_by_ep_rank_0(ckpt, e.name):
            continue  # param_shapes lists local expert names, which are expert-parallel rank 0's global ones
        if e.kind is Kind.PARAM and e.trainable and e.tied_to is None and e.group is not None:
            m = e.piece(Role.MASTER)
            first = m.fragments[0] if m and m.fragments else None
            pos = (first.rank or 0, first.src_offset) if first else (0, 0)
            groups.setdefault(e.group, []).append((*pos, e.name))
    order = tuple(tuple(n for _, _, n in sorted(groups[g])) for g in sorted(groups))
    cfg = (ckpt.ds_config or {}).get("zero_optimization") or {}
    names = [e.name for e in ckpt.entries if e.kind is Kind.PARAM and e.tied_to is None]
    return SourceFacts(
        group_flat_order=order,
        subgroup_to_group=tuple(range(len(order))),
        round_robin=bool(cfg.get("round_robin_gradients", False)),
        parameter_alignment=bool(cfg.get("parameter_alignment", False)),
        sub_group_size=int(cfg.get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)) if ckpt.zero_stage == 3 else None,
        param_ds_ids=tuple((n, i) for i, n in enumerate(names)),
    )


def recorded_vocab_divisor(model_states: Mapping[str, Any]) -> int | None:
    """Megatron's ``make_vocab_size_divisible_by`` where the client state records it: Megatron-DeepSpeed saves its
    ``args`` (an ``argparse.Namespace``, read as a stand-in with its attributes; or a dict) in every model-states
    file. None when absent or not a positive integer."""
    from ..stand_ins import DeepSpeedObject

    args = model_states.get("args")
    fields = args if isinstance(args, Mapping) else vars(args) if isinstance(args, DeepSpeedObject) else {}
    v = fields.get("make_vocab_size_divisible_by")
    return v if isinstance(v, int) and not isinstance(v, bool) and v > 0 else None
