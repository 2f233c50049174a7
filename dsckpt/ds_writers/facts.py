"""What a plan needs to know about its source beyond the logical model, and what cannot be planned.

:func:`read_source_facts` reads the few layout facts the writers plan with (flat order from
``param_shapes``, stage-3 sub-groups and ``ds_id`` s, round robin, parameter alignment) from the
source's rank-0 files -- pickles only, no tensor bytes -- and refuses up front, in one message, what
no writer can reproduce (tensor/pipeline parallel sizes, NVMe offload, optimizers other than
Adam/AdamW, amsgrad, elastic or AutoEP layouts, unequal Adam steps). :func:`derive_facts` recovers
the same facts from the logical model alone (pure; used by tests and dry runs without a cache).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import OSD
from ..model import Kind, LogicalCheckpoint, Role, TensorEntry
from ..partition import DEFAULT_SUB_GROUP_SIZE
from .moe import held_by_ep_rank_0
from .plan import SourceFacts, source_layout_stage

__all__ = ["derive_facts", "entries_by_name", "read_source_facts", "refusal_message", "refusals_from_logical"]

ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
SUPPORTED_OPTIMIZERS = frozenset({"adam", "adamw"})


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
    opt_cfg = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), Mapping) else None
    if opt_cfg is not None and str(opt_cfg.get("type", "")).lower() not in SUPPORTED_OPTIMIZERS:
        problems.append(f"optimizer type '{opt_cfg.get('type')}' in ds_config (only Adam/AdamW are supported)")
    offload = zcfg.get("offload_optimizer") or {}
    if isinstance(offload, Mapping) and str(offload.get("device", "")).lower() == "nvme":
        problems.append("ZeRO-3 optimizer state offloaded to NVMe (offload_optimizer.device = nvme)")
    if (ckpt.tag_dir / "offloaded_tensors").exists():
        problems.append("an 'offloaded_tensors/' folder (NVMe-swapped optimizer state)")

    if source_layout_stage(ckpt) == 0:
        if problems:
            raise UnsupportedCheckpointError(refusal_message(ckpt, problems))
        return SourceFacts((), ())

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
            problems.append("an elastic-checkpoint optimizer state (zero_optimization.elastic_checkpoint); "
                            "save without elastic_checkpoint")
            base = {}
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
    extra_keys = sorted({str(k) for s in state.values() if isinstance(s, Mapping) for k in s} - ADAM_STATE_KEYS)
    if extra_keys:
        problems.append(f"optimizer state keys {extra_keys} (only Adam/AdamW's step, exp_avg, exp_avg_sq "
                        "are supported; amsgrad and other optimizers are not)")
    if any(isinstance(g, Mapping) and g.get("amsgrad") for g in param_groups):
        problems.append("amsgrad=True in the optimizer param groups")
    if any(isinstance(g, Mapping) and "momentum" in g and "betas" not in g for g in param_groups):
        problems.append("an SGD-style optimizer (param groups have 'momentum', no 'betas')")
    steps = set()
    from ..tensor_ref import TensorRef

    for s in state.values():
        if isinstance(s, Mapping) and "step" in s:
            v = s["step"]
            steps.add(float(v.item()) if isinstance(v, TensorRef) else float(v))
    if len(steps) > 1:
        problems.append(f"different Adam step counts across groups {sorted(steps)}")
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
    # ZeRO-3's ds_id: a param's position among the module's own params (tied aliases and buffers
    # left out), the order DeepSpeed partitions them in (stage3.py:1174).
    module = ms0.get("module") or {}
    buffers = set(ms0.get("buffer_names") or ())
    tied = set((ms0.get("shared_params") or {}).keys())
    ds_ids = tuple((n, i) for i, n in enumerate(n for n in module if n not in buffers and n not in tied))
    return SourceFacts(
        group_flat_order=flat_order,
        subgroup_to_group=tuple(sub_to_group),
        round_robin=bool(zcfg.get("round_robin_gradients", False)),
        parameter_alignment=bool(zcfg.get("parameter_alignment", False)),
        sub_group_size=int(sub_group_size) if sub_group_size is not None else None,
        param_ds_ids=ds_ids,
    )


def refusals_from_logical(ckpt: LogicalCheckpoint) -> list[str]:
    problems = []
    if ckpt.tp_world_size > 1 and ckpt.tensor_parallel is None:
        problems.append(f"tensor parallel size {ckpt.tp_world_size} without a tensor-parallel record")
    if (ckpt.pp_world_size > 1 or ckpt.layout == "pipeline") and (ckpt.pipeline is None or ckpt.tp_world_size > 1):
        problems.append(f"pipeline parallel size {ckpt.pp_world_size}" + (
            f" x tensor parallel size {ckpt.tp_world_size}" if ckpt.tp_world_size > 1 else ""))
    if ckpt.pipeline is not None and source_layout_stage(ckpt) == 0:
        problems.append("a pipeline run without ZeRO or BF16_Optimizer (its optimizer state sits in each stage's "
                        "mp_rank_XX_model_states.pt, which dsckpt does not read yet)")
    if ckpt.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {ckpt.zero_stage}")
    if ckpt.layout.startswith("universal"):
        problems.append("a DeepSpeed universal checkpoint, which DeepSpeed loads on any rank count with "
                        "load_universal; it is read (info, to-fp32, scan), not rewritten")
    return problems


def refusal_message(ckpt: LogicalCheckpoint, problems: list[str]) -> str:
    return (f"cannot reshard '{ckpt.tag_dir}': found " + "; ".join(problems)
            + ". dsckpt reshard supports data-parallel ZeRO 0-3 checkpoints trained with Adam/AdamW")



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
