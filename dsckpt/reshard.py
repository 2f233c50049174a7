"""Re-partition a ZeRO checkpoint for a new data-parallel world size (``dsckpt reshard``).

:func:`plan_reshard` is pure: from the logical checkpoint (and the few layout facts
:func:`read_source_facts` reads from the files) it decides, for every target rank and every param
group (stage 1/2) or sub-group (stage 3), which element ranges of which source tensors land where
in the new flat partitions, with DeepSpeed 0.19.8's exact partitioning and padding for the new size.
:func:`run_reshard` then writes a complete new save dir (``latest`` + the same tag) one flat
partition at a time, verifies it, and moves it into place atomically. The input is only read.

What DeepSpeed's loader reads and checks, and therefore what is rewritten (engine.py:4568-4850,
stage_1_and_2.py:3651-3787, stage3.py:3540-3620, bf16_optimizer.py:655-690):

* every model-states file: ``dp_world_size`` (the resume guard, engine.py:4744-4753);
  ``param_shapes`` (flat order; changes with the size under ``round_robin_gradients`` and, at
  stage 3, with the sub-groups);
* stage 1/2 / ``BF16_Optimizer``, per rank: ``single_partition_of_fp32_groups`` (ZeRO strips the
  rank's padding, BF16_Optimizer keeps it), the inner Adam state (``exp_avg``/``exp_avg_sq`` the
  full padded partition, ``step``, ``param_groups``), ``group_paddings``, ``partition_count``,
  ``param_slice_mappings``, ``param_alignment_paddings``; scalars (``loss_scaler``, ``clip_grad``,
  ``zero_stage`` ...) copied;
* stage 3, per rank: ``fp32_flat_groups`` and the inner Adam state per *sub-group* (sub-groups are
  re-formed for the new size), ``partition_count``; model-states ``frozen_param_fragments``
  re-partitioned, placeholders and buffers copied;
* stage 0: only ``dp_world_size`` (MoE: expert and ``expp_rank_*`` files copied).
* MoE (ZeRO-1/2, :mod:`dsckpt.readers.moe`): the expert-parallel size is kept; each expert group is
  re-partitioned over the new expert-data-parallel size (``world / ep_size``, its
  ``partition_count``), every target rank holding its expert-parallel rank's experts under their
  local names (:mod:`dsckpt.expert_parallel`); the ``layer_*_expert_*`` files are copied.
"""

from __future__ import annotations

import enum
import logging
import os
import shutil
from collections import OrderedDict
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from .expert_parallel import (
    EXPERT_NAME,
    ExpertTopology,
    expert_data_parallel_rank,
    expert_parallel_rank,
    global_expert_name,
)
from .hf import HfFilesPlan, copy_files, plan_resume_files
from .model import Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from .partition import (
    DEFAULT_SUB_GROUP_SIZE,
    bf16_optimizer_group_padding,
    param_alignment_paddings,
    round_robin_order,
    zero3_partition_numel,
    zero3_sub_groups,
    zero12_group_layout,
    zero12_param_slice_mappings,
)

__all__ = [
    "RangeCopy",
    "FlatSpec",
    "GroupPartition",
    "RankPlan",
    "SourceFacts",
    "ReshardPlan",
    "ReshardResult",
    "Verify",
    "read_source_facts",
    "plan_reshard",
    "run_reshard",
    "output_nbytes_bound",
    "describe_plan",
]

logger = logging.getLogger(__name__)

OSD = "optimizer_state_dict"
ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
SUPPORTED_OPTIMIZERS = frozenset({"adam", "adamw"})
ZERO_TO_FP32_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


# --------------------------------------------------------------------------------------------
# The plan


@dataclass(frozen=True)
class RangeCopy:
    """``numel`` elements at ``src_offset`` of the flat tensor ``key`` in ``file`` go to
    ``dst_offset`` of the target tensor."""

    file: Path
    key: tuple[Any, ...]
    src_offset: int
    numel: int
    dst_offset: int


@dataclass(frozen=True)
class FlatSpec:
    """One 1-D target tensor: ``numel`` elements of ``dtype``, zero except where ``copies`` write."""

    numel: int
    dtype: str
    copies: tuple[RangeCopy, ...]

    @property
    def copied_numel(self) -> int:
        return sum(c.numel for c in self.copies)


@dataclass(frozen=True)
class GroupPartition:
    """One target rank's share of one param group (stage 1/2) or fp32 sub-group (stage 3)."""

    group: int
    partition_numel: int  # padded partition length: the Adam moments' length
    padding_numel: int  # the ``group_paddings`` entry written for this rank (stage 1/2)
    master: FlatSpec  # fp32 master as stored (ZeRO-1/2 strips the padding)
    exp_avg: FlatSpec
    exp_avg_sq: FlatSpec
    slice_mappings: tuple[tuple[str, int, int], ...] = ()  # (name, start, numel), stage 1/2
    ds_id: str | None = None  # stage 3: "<first ds_id>_<last ds_id>" of the sub-group
    partition_count: int | None = None  # MoE expert group: the expert-data-parallel size (else the world size)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    optim_file: str | None
    model_file: str | None  # stage 3: this rank's model-states file
    groups: tuple[GroupPartition, ...]
    frozen_fragments: tuple[tuple[str, FlatSpec], ...] = ()  # stage 3


@dataclass(frozen=True)
class SourceFacts:
    """Layout facts a plan needs beyond the logical model (see :func:`read_source_facts`).

    ``group_flat_order``: per source group (stage 1/2) or sub-group (stage 3), the trainable param
    names in flat-buffer order (``param_shapes``). ``subgroup_to_group``: the optimizer param group
    of each stage-3 sub-group. ``param_ds_ids``: stage 3, each param's ``ds_id``.
    """

    group_flat_order: tuple[tuple[str, ...], ...]
    subgroup_to_group: tuple[int, ...]
    round_robin: bool = False
    parameter_alignment: bool = False
    sub_group_size: int | None = DEFAULT_SUB_GROUP_SIZE
    param_ds_ids: tuple[tuple[str, int], ...] = ()


@dataclass(frozen=True)
class ReshardPlan:
    source_root: Path
    source_tag_dir: Path
    tag: str
    layout: str
    zero_stage: int
    optimizer_wrapper: str
    precision: Precision
    source_world_size: int
    world_size: int
    source_model_files: tuple[Path, ...]  # mp_rank_00 (stage 0-2) or one per source rank (stage 3)
    source_optim_files: tuple[Path, ...]
    bf16_prefixed_optim: bool
    param_shapes: tuple[tuple[tuple[str, tuple[int, ...]], ...], ...]  # target, flat order
    subgroup_to_group: tuple[int, ...]
    alignment_paddings: tuple[tuple[int, ...], ...]
    ranks: tuple[RankPlan, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    hf_files: HfFilesPlan | None = None  # the Trainer's files carried into OUT (see dsckpt.hf)
    copied_model_files: tuple[Path, ...] = ()  # MoE expert files, rewritten unchanged

    @property
    def has_work(self) -> bool:
        return self.world_size != self.source_world_size

    @property
    def copied_nbytes(self) -> int:
        total = 0
        for r in self.ranks:
            for g in r.groups:
                total += 4 * (g.master.numel + g.exp_avg.numel + g.exp_avg_sq.numel)
            for _, spec in r.frozen_fragments:
                total += 2 * spec.numel
        return total


@dataclass(frozen=True)
class ReshardResult:
    output: Path
    tag: str
    files: tuple[Path, ...]
    verified_tensors: int  # stored copies (tensor, role) compared with the input
    verification: str = "quick"  # a :class:`Verify` value
    hf_files: tuple[Path, ...] = ()  # the Trainer's files copied into OUT


# --------------------------------------------------------------------------------------------
# Source facts (I/O) and up-front refusals


def read_source_facts(ckpt: LogicalCheckpoint, cache: Any) -> SourceFacts:
    """Read the layout facts :func:`plan_reshard` needs and refuse what cannot be resharded.

    Every problem found is reported in one :class:`UnsupportedCheckpointError`.
    """
    from .layout import classify_files

    problems = _refusals_from_logical(ckpt)
    if problems:
        raise UnsupportedCheckpointError(_refusal_message(ckpt, problems))
    ckpt.require_unambiguous("reshard", moments=True)
    files = classify_files(ckpt.root, ckpt.tag, ckpt.tag_dir)
    cfg = ckpt.ds_config or {}
    zcfg = cfg.get("zero_optimization") if isinstance(cfg.get("zero_optimization"), Mapping) else {}
    opt_cfg = cfg.get("optimizer") if isinstance(cfg.get("optimizer"), Mapping) else None
    if opt_cfg is not None and str(opt_cfg.get("type", "")).lower() not in SUPPORTED_OPTIMIZERS:
        problems.append(f"optimizer type '{opt_cfg.get('type')}' in ds_config (only Adam/AdamW are supported)")
    offload = (zcfg or {}).get("offload_optimizer") or {}
    if isinstance(offload, Mapping) and str(offload.get("device", "")).lower() == "nvme":
        problems.append("ZeRO-3 optimizer state offloaded to NVMe (offload_optimizer.device = nvme)")
    if (ckpt.tag_dir / "offloaded_tensors").exists():
        problems.append("an 'offloaded_tensors/' folder (NVMe-swapped optimizer state)")

    if _partition_stage(ckpt) == 0:
        if problems:
            raise UnsupportedCheckpointError(_refusal_message(ckpt, problems))
        return SourceFacts((), ())

    optim_files = [files.dp_mp_to_optim_states[(d, 0)] for d in range(ckpt.dp_world_size)]
    osd0 = cache.tree(optim_files[0]).get(OSD) or {}
    if ckpt.zero_stage == 3:
        ms0 = cache.tree(files.dp_mp_to_zero3_model_states[(0, 0)])
        inner = osd0.get(OSD) or {}
        state = inner.get("state") or {}
        param_groups = inner.get("param_groups") or []
        if osd0.get("ds_zero_partition_groups") is not None:
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
        if ckpt.moe is None and isinstance(counts, list) and any(int(c) != ckpt.dp_world_size for c in counts):
            problems.append(f"partition_count {counts} (MoE expert groups partitioned over fewer ranks)")
    if ckpt.moe is None and ms0.get("num_experts") is not None:
        problems.append("Mixture-of-Experts layers ('num_experts' in the model states)")
    if ckpt.moe is not None and bool((zcfg or {}).get("round_robin_gradients", False)):
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
    from .safe_load import TensorRef

    for s in state.values():
        if isinstance(s, Mapping) and "step" in s:
            v = s["step"]
            steps.add(_scalar(v) if isinstance(v, TensorRef) else float(v))
    if len(steps) > 1:
        problems.append(f"different Adam step counts across groups {sorted(steps)}")
    if problems:
        raise UnsupportedCheckpointError(_refusal_message(ckpt, problems))

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
        sub_group_size = (zcfg or {}).get("sub_group_size", DEFAULT_SUB_GROUP_SIZE)
        module = ms0.get("module") or {}
        buffers = set(ms0.get("buffer_names") or ())
        tied = set((ms0.get("shared_params") or {}).keys())
        ds_names = [n for n in module if n not in buffers and n not in tied]
        ds_ids = tuple((n, i) for i, n in enumerate(ds_names))
    else:
        sub_to_group = list(range(len(flat_order)))
        sub_group_size = None
        ds_ids = ()
    return SourceFacts(
        group_flat_order=flat_order,
        subgroup_to_group=tuple(sub_to_group),
        round_robin=bool((zcfg or {}).get("round_robin_gradients", False)),
        parameter_alignment=bool((zcfg or {}).get("parameter_alignment", False)),
        sub_group_size=int(sub_group_size) if sub_group_size is not None else None,
        param_ds_ids=ds_ids,
    )


def _scalar(ref: Any) -> float:
    """The value of a one-element tensor such as Adam's ``step``, read without torch."""
    import struct

    from .writers.torch_stream import dtype_name, element_nbytes

    codes = {"float32": "<f", "float64": "<d", "int64": "<q", "int32": "<i", "float16": "<e"}
    name = dtype_name(ref)
    if ref.numel != 1 or name not in codes or not ref.is_contiguous():
        return float(ref.load().item())
    raw = ref.read_numpy(0, 1).tobytes()  # through safe_load's reads: CRC-checked
    assert len(raw) == element_nbytes(name)
    return float(struct.unpack(codes[name], raw)[0])


def _refusals_from_logical(ckpt: LogicalCheckpoint) -> list[str]:
    problems = []
    if ckpt.tp_world_size > 1:
        problems.append(f"tensor parallel size {ckpt.tp_world_size}")
    if ckpt.pp_world_size > 1 or ckpt.layout == "pipeline":
        problems.append(f"pipeline parallel size {ckpt.pp_world_size}")
    if ckpt.zero_stage not in (0, 1, 2, 3):
        problems.append(f"ZeRO stage {ckpt.zero_stage}")
    return problems


def _refusal_message(ckpt: LogicalCheckpoint, problems: list[str]) -> str:
    return (f"cannot reshard '{ckpt.tag_dir}': found " + "; ".join(problems)
            + ". dsckpt reshard supports data-parallel ZeRO 0-3 checkpoints trained with Adam/AdamW")


# --------------------------------------------------------------------------------------------
# Planning (pure)


def _element_nbytes(precision: Precision) -> int:
    return 4 if precision is Precision.FP32 else 2


def _copies(piece: Piece | None, elem_start: int, numel: int, dst_offset: int, name: str) -> tuple[RangeCopy, ...]:
    """Where elements ``[elem_start, elem_start + numel)`` of a logical tensor are stored."""
    if piece is None or numel <= 0:
        return ()
    out = []
    end = elem_start + numel
    covered = 0
    for f in piece.fragments:
        lo = max(elem_start, f.dst_offset)
        hi = min(end, f.dst_offset + f.numel)
        if lo < hi:
            out.append(RangeCopy(f.file, f.key, f.src_offset + (lo - f.dst_offset), hi - lo,
                                 dst_offset + (lo - elem_start)))
            covered += hi - lo
    if covered != numel:
        raise CorruptCheckpointError(
            f"tensor '{name}': its {piece.role.value} copy covers {covered} of elements "
            f"[{elem_start}, {end}); the checkpoint's fragments are incomplete")
    return tuple(out)


def _coalesce(copies: Sequence[RangeCopy]) -> tuple[RangeCopy, ...]:
    """Merge ranges that continue each other in both source and target (fewer, larger reads)."""
    out: list[RangeCopy] = []
    for c in copies:
        last = out[-1] if out else None
        if (last is not None and last.file == c.file and last.key == c.key
                and last.src_offset + last.numel == c.src_offset and last.dst_offset + last.numel == c.dst_offset):
            out[-1] = RangeCopy(c.file, c.key, last.src_offset, last.numel + c.numel, last.dst_offset)
        else:
            out.append(c)
    return tuple(out)


def _entries_by_name(ckpt: LogicalCheckpoint) -> dict[str, TensorEntry]:
    return {e.name: e for e in ckpt.entries}


def _derive_facts(ckpt: LogicalCheckpoint) -> SourceFacts:
    """Facts recoverable from the logical model alone (flat order from the fragment positions)."""
    groups: dict[int, list[tuple[int, int, str]]] = {}
    for e in ckpt.entries:
        if ckpt.moe is not None and not _held_by_ep_rank_0(ckpt, e.name):
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
        param_ds_ids=tuple((n, i) for i, n in enumerate(names)) if ckpt.zero_stage == 3 else (),
    )


def _held_by_ep_rank_0(ckpt: LogicalCheckpoint, name: str) -> bool:
    m = EXPERT_NAME.match(name)
    if m is None or ckpt.moe is None:
        return True
    return int(m["id"]) < ckpt.moe.local_experts(m["prefix"])


def _expert_groups(ckpt: LogicalCheckpoint, world: int) -> list[int | None]:
    """Per param group: its expert-parallel size (kept), or None for a dense group; refuses target
    sizes the expert-parallel size does not divide."""
    if ckpt.moe is None:
        return []
    bad = sorted({ep for ep in ckpt.moe.group_ep_sizes if ep is not None and world % ep})
    if bad:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to {world} ranks: its experts are split over expert-parallel "
            f"size {bad[0]}, which must divide the new world size, and changing the expert-parallel size is "
            f"not supported; pick a multiple of {bad[0]}")
    return list(ckpt.moe.group_ep_sizes)


def plan_reshard(ckpt: LogicalCheckpoint, world_size: int, *, facts: SourceFacts | None = None,
                 hf_files: bool = True) -> ReshardPlan:
    """Decide every byte range of the checkpoint resharded to ``world_size`` ranks. No tensor I/O.

    ``facts`` comes from :func:`read_source_facts`; without it, it is derived from ``ckpt`` and its
    ``ds_config`` (enough for tests; stage-3 sub-groups are then assumed to be one per param group).
    When the save dir is a Hugging Face Trainer folder (``checkpoint-N/``) and ``hf_files``, the
    plan also carries the Trainer's files into OUT (:func:`dsckpt.hf.plan_resume_files`: names
    listed from the folder, nothing opened), RNG states mapped to the new rank count.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--world-size must be a positive integer, got {world_size!r}")
    problems = _refusals_from_logical(ckpt)
    if problems:
        raise UnsupportedCheckpointError(_refusal_message(ckpt, problems))
    facts = facts if facts is not None else _derive_facts(ckpt)
    optim = tuple(p for p in ckpt.files if "optim_states" in p.name)
    bf16_prefix = any(p.name.startswith("bf16_") for p in optim)
    optim_sorted = tuple(sorted(optim, key=_rank_of))
    common: dict[str, Any] = dict(
        source_root=ckpt.root, source_tag_dir=ckpt.tag_dir, tag=ckpt.tag, layout=ckpt.layout,
        zero_stage=_partition_stage(ckpt), optimizer_wrapper=ckpt.optimizer_wrapper, precision=ckpt.precision,
        source_world_size=ckpt.dp_world_size, world_size=world_size, source_optim_files=optim_sorted,
        bf16_prefixed_optim=bf16_prefix,
        hf_files=_plan_hf_files(ckpt, world_size) if hf_files else None,
    )
    if _partition_stage(ckpt) == 0:
        models = tuple(p for p in ckpt.files if p.name.startswith("mp_rank_") and p.name.endswith("_model_states.pt"))
        notes = ["stage 0: nothing is partitioned; only the recorded dp_world_size changes"]
        copied: tuple[Path, ...] = ()
        if ckpt.moe is not None:  # expp_rank_{R} files belong to expert-parallel ranks, which are kept
            _expert_groups(ckpt, world_size)
            copied = (*ckpt.moe.expert_files, *ckpt.moe.expp_optim_files)
            notes.append(f"Mixture of Experts: expert-parallel size kept at {', '.join(map(str, ckpt.moe.ep_sizes))}; "
                         f"the {len(copied)} expert and expert-parallel optimizer files are copied unchanged")
        return ReshardPlan(**common, source_model_files=models, param_shapes=(), subgroup_to_group=(),
                           alignment_paddings=(), ranks=(), notes=tuple(notes), copied_model_files=copied)
    if ckpt.zero_stage == 3:
        return _plan_zero3(ckpt, world_size, facts, common)
    if ckpt.moe is not None and facts.round_robin:
        raise UnsupportedCheckpointError(_refusal_message(ckpt, ["Mixture-of-Experts with round_robin_gradients"]))
    return _plan_zero12(ckpt, world_size, facts, common)


def _partition_stage(ckpt: LogicalCheckpoint) -> int:
    """The ZeRO stage whose file layout ``ckpt`` uses. DeepSpeed 0.10.3 to 0.16.9 (written by 0.14.5 and
    0.16.9) wrap stage-0 bf16 in BF16_Optimizer -- their bf16 grad_accum_dtype defaults to fp32 without ZeRO --
    so the fp32 masters are partitioned in ``bf16_zero_pp_rank_*`` files like ZeRO-1, while the ds_config
    (kept as written) says stage 0. 0.18.9 and 0.19.8 default grad_accum_dtype to bf16 and use
    FP16_UnfusedOptimizer there."""
    if ckpt.zero_stage == 0 and ckpt.optimizer_wrapper == "BF16_Optimizer":
        return 1
    return ckpt.zero_stage


def _plan_hf_files(ckpt: LogicalCheckpoint, world_size: int) -> HfFilesPlan | None:
    from .layout import list_tags

    return plan_resume_files(ckpt.root, world_size, tag=ckpt.tag,
                             tag_dirs=frozenset(list_tags(ckpt.root)) | {ckpt.tag})


def _rank_of(path: Path) -> int:
    import re

    m = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(m[1]) if m else -1


def _optim_name(rank: int, bf16_prefix: bool) -> str:
    return f"{'bf16_' if bf16_prefix else ''}zero_pp_rank_{rank}_mp_rank_00_optim_states.pt"


def _plan_zero12(ckpt: LogicalCheckpoint, world: int, facts: SourceFacts, common: dict[str, Any]) -> ReshardPlan:
    by_name = _entries_by_name(ckpt)
    bf16_opt = ckpt.optimizer_wrapper == "BF16_Optimizer"
    elem = _element_nbytes(ckpt.precision)
    src_world = ckpt.dp_world_size
    group_ep = _expert_groups(ckpt, world)
    param_shapes = []
    all_paddings = []
    # per group: (names in target flat order, offsets, layout, names in bit16 order)
    group_layouts = []
    for g, src_flat in enumerate(facts.group_flat_order):
        n = len(src_flat)
        original: list[str]
        flat: list[str]
        if facts.round_robin and not bf16_opt:
            original = [""] * n
            for pos, idx in enumerate(round_robin_order(n, src_world)):
                original[idx] = src_flat[pos]
            flat = [original[i] for i in round_robin_order(n, world)]
        else:
            original = list(src_flat)
            flat = list(src_flat)
        for name in flat:
            if name not in by_name:
                raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{name}' of group {g} has no stored values")
        numels = [by_name[nm].numel for nm in flat]
        pads = param_alignment_paddings(numels, elem, enabled=facts.parameter_alignment and not bf16_opt)
        ep = group_ep[g] if g < len(group_ep) else None
        # An expert group is partitioned over the expert-data-parallel group only (its alignment too:
        # stage_1_and_2.py uses the size of real_dp_process_group[g]).
        layout = zero12_group_layout(numels, world // ep if ep else world, alignment_paddings=pads)
        param_shapes.append(tuple((nm, by_name[nm].shape) for nm in flat))
        all_paddings.append(tuple(pads))
        group_layouts.append((flat, layout, original, pads))

    ranks = []
    for r in range(world):
        groups = []
        for g, (flat, layout, original, pads) in enumerate(group_layouts):
            ep = group_ep[g] if g < len(group_ep) else None
            k, resolve = r, (lambda nm: nm)
            if ep:
                topo = ExpertTopology(world, ep, ckpt.moe.data_before_expert if ckpt.moe else False)
                k = expert_data_parallel_rank(r, topo)
                resolve = _global_namer(ckpt, expert_parallel_rank(r, topo))
            p_numel = layout.partition_numel
            p_start = k * p_numel
            padding = (bf16_optimizer_group_padding(layout, k) if bf16_opt else layout.rank_padding(k))
            stored = p_numel if bf16_opt else p_numel - layout.rank_padding(k)
            role_copies: dict[Role, list[RangeCopy]] = {Role.MASTER: [], Role.EXP_AVG: [], Role.EXP_AVG_SQ: []}
            for nm, off, numel in zip(flat, layout.param_offsets, layout.param_numels):
                lo, hi = max(off, p_start), min(off + numel, p_start + p_numel)
                if lo >= hi:
                    continue
                entry = by_name[resolve(nm)]
                for role, lst in role_copies.items():
                    piece = entry.piece(role)
                    if piece is None:
                        raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{nm}' has no {role.value} values")
                    lst.extend(_copies(piece, lo - off, hi - lo, lo - p_start, nm))
            offsets_by_name = dict(zip(flat, layout.param_offsets))
            orig_numels = [by_name[nm].numel for nm in original]
            use_offsets = any(pads)
            maps = zero12_param_slice_mappings(
                orig_numels, p_start, p_numel,
                [offsets_by_name[nm] for nm in original] if use_offsets else None)
            groups.append(GroupPartition(
                group=g, partition_numel=p_numel, padding_numel=padding,
                master=FlatSpec(stored, "float32", _coalesce(role_copies[Role.MASTER])),
                exp_avg=FlatSpec(p_numel, "float32", _coalesce(role_copies[Role.EXP_AVG])),
                exp_avg_sq=FlatSpec(p_numel, "float32", _coalesce(role_copies[Role.EXP_AVG_SQ])),
                slice_mappings=tuple((original[m.index], m.start, m.numel) for m in maps),
                partition_count=layout.world_size if ep else None,
            ))
        ranks.append(RankPlan(r, _optim_name(r, common["bf16_prefixed_optim"]), None, tuple(groups)))
    models = tuple(p for p in ckpt.files if p.name == "mp_rank_00_model_states.pt")
    notes = []
    if facts.round_robin and not bf16_opt:
        notes.append("round_robin_gradients: flat order recomputed for the new size; param_slice_mappings "
                     "reproduce DeepSpeed 0.19.8's own (mis-ordered) mapping")
    copied: tuple[Path, ...] = ()
    if ckpt.moe is not None:
        copied = ckpt.moe.expert_files
        sizes = ", ".join(f"{ep} (expert-data-parallel {src_world // ep} -> {world // ep})"
                          for ep in ckpt.moe.ep_sizes)
        notes.append(f"Mixture of Experts: expert-parallel size kept at {sizes}; the {len(copied)} expert files "
                     "are copied unchanged")
    return ReshardPlan(**common, source_model_files=models, param_shapes=tuple(param_shapes),
                       subgroup_to_group=tuple(range(len(param_shapes))), alignment_paddings=tuple(all_paddings),
                       ranks=tuple(ranks), notes=tuple(notes), copied_model_files=copied)


def _global_namer(ckpt: LogicalCheckpoint, ep_rank: int) -> Callable[[str], str]:
    """Local expert name (``param_shapes``) -> the entry's global name on expert-parallel rank ``ep_rank``."""
    moe = ckpt.moe
    assert moe is not None

    def resolve(name: str) -> str:
        m = EXPERT_NAME.match(name)
        if m is None:
            raise CorruptCheckpointError(f"'{ckpt.tag_dir}': '{name}' sits in an expert group but is no expert param")
        return global_expert_name(name, ep_rank, moe.local_experts(m["prefix"]))
    return resolve


def _plan_zero3(ckpt: LogicalCheckpoint, world: int, facts: SourceFacts, common: dict[str, Any]) -> ReshardPlan:
    by_name = _entries_by_name(ckpt)
    n_groups = max(facts.subgroup_to_group, default=-1) + 1
    group_params: list[list[str]] = [[] for _ in range(n_groups)]
    for s, sub_names in enumerate(facts.group_flat_order):
        group_params[facts.subgroup_to_group[s]].extend(sub_names)
    target_subgroups: list[list[str]] = []
    sub_to_group: list[int] = []
    for g, group_names in enumerate(group_params):
        for idx in zero3_sub_groups([by_name[n].numel for n in group_names], world, facts.sub_group_size):
            target_subgroups.append([group_names[i] for i in idx])
            sub_to_group.append(g)
    ds_ids = dict(facts.param_ds_ids)
    ranks = []
    for r in range(world):
        groups = []
        for t, names in enumerate(target_subgroups):
            offset = 0
            role_copies: dict[Role, list[RangeCopy]] = {Role.MASTER: [], Role.EXP_AVG: [], Role.EXP_AVG_SQ: []}
            for nm in names:
                e = by_name[nm]
                per = zero3_partition_numel(e.numel, world)
                lo, hi = r * per, min((r + 1) * per, e.numel)
                if lo < hi:
                    for role, lst in role_copies.items():
                        piece = e.piece(role)
                        if piece is None:
                            raise CorruptCheckpointError(f"'{ckpt.tag_dir}': param '{nm}' has no {role.value} values")
                        lst.extend(_copies(piece, lo, hi - lo, offset, nm))
                offset += per
            ds_id = (f"{ds_ids[names[0]]}_{ds_ids[names[-1]]}"
                     if names and names[0] in ds_ids and names[-1] in ds_ids else None)
            groups.append(GroupPartition(
                group=t, partition_numel=offset, padding_numel=0,
                master=FlatSpec(offset, "float32", _coalesce(role_copies[Role.MASTER])),
                exp_avg=FlatSpec(offset, "float32", _coalesce(role_copies[Role.EXP_AVG])),
                exp_avg_sq=FlatSpec(offset, "float32", _coalesce(role_copies[Role.EXP_AVG_SQ])),
                ds_id=ds_id,
            ))
        frozen = []
        for e in ckpt.entries:
            if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None:
                per = zero3_partition_numel(e.numel, world)
                lo, hi = r * per, min((r + 1) * per, e.numel)
                piece = e.piece(Role.MODULE)
                dtype = piece.dtype if piece else "float32"
                frozen.append((e.name, FlatSpec(per, dtype, _copies(piece, lo, max(0, hi - lo), 0, e.name))))
        ranks.append(RankPlan(r, _optim_name(r, common["bf16_prefixed_optim"]),
                              f"zero_pp_rank_{r}_mp_rank_00_model_states.pt", tuple(groups), tuple(frozen)))
    models = tuple(sorted((p for p in ckpt.files if p.name.startswith("zero_pp_rank_")
                           and p.name.endswith("_model_states.pt")), key=_rank_of))
    shapes = tuple(tuple((n, by_name[n].shape) for n in names) for names in target_subgroups)
    notes = []
    if len(target_subgroups) != len(facts.group_flat_order):
        notes.append(f"ZeRO-3 sub-groups re-formed for {world} ranks: {len(facts.group_flat_order)} -> "
                     f"{len(target_subgroups)} (sub_group_size counts per-rank partition sizes)")
    return ReshardPlan(**common, source_model_files=models, param_shapes=shapes,
                       subgroup_to_group=tuple(sub_to_group), alignment_paddings=(), ranks=tuple(ranks),
                       notes=tuple(notes))


def describe_plan(plan: ReshardPlan, *, max_copies: int = 6) -> list[str]:
    """Human-readable lines: per target rank and group, sizes, padding and source ranges."""
    lines = [
        f"reshard {plan.source_tag_dir} (ZeRO stage {plan.zero_stage}, {plan.precision.value}, "
        f"{plan.optimizer_wrapper}) from {plan.source_world_size} to {plan.world_size} ranks, tag '{plan.tag}'",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    for r in plan.ranks:
        files = ", ".join(f for f in (r.optim_file, r.model_file) if f)
        lines.append(f"rank {r.rank}: {files}")
        for g in r.groups:
            label = "sub-group" if plan.zero_stage == 3 else "group"
            lines.append(f"  {label} {g.group}: partition {g.partition_numel} elements, padding "
                         f"{g.partition_numel - g.master.copied_numel}, fp32 master stored {g.master.numel}")
            for c in g.master.copies[:max_copies]:
                lines.append(f"    [{c.dst_offset}:{c.dst_offset + c.numel}) <- {c.file.name} "
                             f"{_fmt_key(c.key)}[{c.src_offset}:{c.src_offset + c.numel})")
            if len(g.master.copies) > max_copies:
                lines.append(f"    ... {len(g.master.copies) - max_copies} more ranges")
        for name, spec in r.frozen_fragments:
            lines.append(f"  frozen {name}: {spec.numel} elements ({spec.copied_numel} copied)")
    if plan.copied_model_files:
        lines.append("copy " + ", ".join(p.name for p in plan.copied_model_files))
    if plan.zero_stage == 0:
        lines.append("rewrite " + ", ".join(p.name for p in plan.source_model_files)
                     + f" with dp_world_size={plan.world_size}")
    if plan.hf_files is not None:
        lines.append(f"Hugging Face Trainer files from {plan.hf_files.folder} (byte for byte):")
        lines += plan.hf_files.describe()
    return lines


def _fmt_key(key: tuple[Any, ...]) -> str:
    return "".join(f"[{k!r}]" for k in key[1:]) if key and key[0] == OSD else "".join(f"[{k!r}]" for k in key)


# --------------------------------------------------------------------------------------------
# Doing it


class Verify(enum.Enum):
    """How :func:`run_reshard` checks what it wrote before moving it into place."""

    NONE = "none"
    QUICK = "quick"  # re-open every file; names, shapes, dtypes; sampled values of every stored copy
    FULL = "full"  # ... and every value of every stored copy, bit for bit


def run_reshard(plan: ReshardPlan, out: str | os.PathLike[str], *, cache: Any = None, force: bool = False,
                verify: Verify | str | bool = Verify.QUICK,
                on_file: Callable[[Path], None] | None = None, workers: int | None = None,
                fsync: bool = True) -> ReshardResult:
    """Write the resharded checkpoint as a new save dir ``out`` (``latest`` + ``<tag>/``).

    Every target file is streamed storage by storage from byte ranges of the source files through one
    reused buffer (zero padding is written, never allocated); the input is only read. ``verify``
    (``True`` = ``"quick"``, ``False`` = ``"none"``): the output is re-opened through the readers and
    compared with the source -- names, shapes, dtypes, world size, and for every stored copy of every
    tensor the values around every fragment boundary plus evenly spaced samples (``"quick"``), or all
    values (``"full"``, which reads input and output once more) -- before it is moved into place.
    The plan's Hugging Face Trainer files are copied into the same temporary folder, so OUT appears
    complete or not at all.

    ``workers`` target files are written at once (default :func:`default_workers`; each has a reader
    thread of its own), so that copying and CRC-32 checking use several cores where the disk allows.

    Every file is fsync'd before OUT is renamed into place; ``fsync=False`` skips that (OUT still
    appears complete or not at all, but a power loss soon after may leave it incomplete).
    """
    from .atomic import atomic_dir, background_fsync, claim_output
    from .readers import FileCache

    mode = Verify.QUICK if verify is True else Verify.NONE if verify is False else Verify(verify)
    out = Path(out)
    src_root = plan.source_root.resolve()
    if out.resolve() == src_root or src_root in out.resolve().parents or out.resolve() in src_root.parents:
        raise UsageError(f"output '{out}' overlaps the input '{plan.source_root}'; choose a new folder")
    cache = cache if cache is not None else FileCache()
    written: list[Path] = []
    with claim_output(out, force=force, nbytes=output_nbytes_bound(plan)), atomic_dir(out, fsync=fsync) as tmp:
        tag_dir = tmp / plan.tag
        tag_dir.mkdir(parents=True)
        for f in _write_files(plan, tag_dir, cache, workers=default_workers() if workers is None else workers,
                              writeback=fsync):
            written.append(f)
            if on_file is not None:
                on_file(f)
        (tmp / "latest").write_text(plan.tag, encoding="utf-8")
        for script in ZERO_TO_FP32_SCRIPTS:
            if (plan.source_root / script).is_file():
                shutil.copy2(plan.source_root / script, tmp / script)
        hf = copy_files(plan.hf_files, tmp) if plan.hf_files is not None else []
        with background_fsync(tmp, enabled=fsync):  # the disk finishes the write-back while we verify
            checked = 0 if mode is Verify.NONE else _verify(plan, tmp, cache, full=mode is Verify.FULL)
            cache.finish_checks()  # CRC-32s of source records read only partly; a mismatch leaves no output
    return ReshardResult(out, plan.tag, tuple(out / plan.tag / f.name for f in written), checked, mode.value,
                         tuple(out / f.relative_to(tmp) for f in hf))


def output_nbytes_bound(plan: ReshardPlan) -> int:
    """An upper estimate of what :func:`run_reshard` writes, for the free-space check: the flat
    partitions, the model-states files (one per target rank at stage 3), the scripts, and 64 KiB of
    pickle and zip records per file."""
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    models = [size(p) for p in plan.source_model_files]
    copied = sum(size(p) for p in plan.copied_model_files)
    model_nbytes = max(models, default=0) * plan.world_size if plan.zero_stage == 3 else sum(models)
    scripts = sum(size(plan.source_root / s) for s in ZERO_TO_FP32_SCRIPTS)
    files = len(plan.source_model_files) + 2 * len(plan.ranks) + 3
    hf = plan.hf_files.nbytes if plan.hf_files is not None else 0
    files += len(plan.copied_model_files)
    return plan.copied_nbytes + model_nbytes + copied + scripts + hf + (64 << 10) * files


def _streamed(spec: FlatSpec, cache: Any, attrs: dict[str, Any] | None = None) -> Any:
    """The target tensor of ``spec`` as source byte ranges with zero runs between them."""
    from .writers.torch_stream import Extent, StreamedTensor, dtype_name, element_nbytes

    item = element_nbytes(spec.dtype)
    extents: list[Extent] = []
    pos = 0  # elements of the target covered so far

    def add(ext: Extent) -> None:
        last = extents[-1] if extents else None
        if last is not None and last.path == ext.path and last.record is ext.record and (
                ext.path is None or last.file_offset + last.nbytes == ext.file_offset):
            extents[-1] = Extent(last.path, last.file_offset, last.nbytes + ext.nbytes, last.record,
                                 last.record_offset)
        else:
            extents.append(ext)

    for c in sorted(spec.copies, key=lambda c: c.dst_offset):
        ref = cache.tensor(c.file, c.key)
        if dtype_name(ref) != spec.dtype:
            raise CorruptCheckpointError(f"{c.file}: {_fmt_key(c.key)} is {dtype_name(ref)}, expected {spec.dtype}")
        if not ref.is_contiguous():
            raise UnsupportedCheckpointError(
                f"{c.file}: {_fmt_key(c.key)} is stored non-contiguously; flat ZeRO partitions never are")
        first = ref.storage_offset + c.src_offset
        if c.src_offset < 0 or c.src_offset + c.numel > ref.numel or first + c.numel > ref.storage.numel:
            raise CorruptCheckpointError(
                f"{c.file}: {_fmt_key(c.key)} has {ref.numel} elements, but the checkpoint's metadata places "
                f"elements [{c.src_offset}, {c.src_offset + c.numel}) in it; the metadata does not match")
        assert c.dst_offset >= pos and c.dst_offset + c.numel <= spec.numel, "overlapping copy ranges"
        if c.dst_offset > pos:
            add(Extent(None, 0, (c.dst_offset - pos) * item))
        add(Extent(Path(ref.storage.path), ref.storage.file_offset + first * item, c.numel * item,
                   ref.storage.check, first * item))
        pos = c.dst_offset + c.numel
    if pos < spec.numel:
        add(Extent(None, 0, (spec.numel - pos) * item))
    return StreamedTensor(spec.dtype, (spec.numel,), tuple(extents), dict(attrs or {}))


def _own_copy(value: Any) -> Any:
    """A storage of its own for a small per-group state value such as Adam's ``step``: torch's
    ``Optimizer.load_state_dict`` keeps ``step`` tensors as loaded, so one pickled storage shared by
    several groups would be incremented once per group and step."""
    from .safe_load import TensorRef
    from .writers.torch_stream import Extent, StreamedTensor, dtype_name, element_nbytes

    if not isinstance(value, TensorRef):
        return value
    if not value.is_contiguous():
        return value.load().clone()
    item = element_nbytes(dtype_name(value))
    ext = Extent(Path(value.storage.path), value.storage.file_offset + value.storage_offset * item,
                 value.numel * item, value.storage.check, value.storage_offset * item)
    return StreamedTensor(dtype_name(value), tuple(value.shape), (ext,), dict(value.attrs))


def _fragment_address(numel: int, start: int) -> Any:
    from .safe_load import stand_in_class

    cls = stand_in_class("deepspeed.utils.tensor_fragment", "fragment_address")
    assert cls is not None
    obj = cls.__new__(cls)
    obj.__dict__.update(numel=numel, start=start)
    return obj


def _shapes_tree(plan: ReshardPlan, like: Any = None) -> list[OrderedDict[str, Any]]:
    """``param_shapes`` as DeepSpeed writes them: ``torch.Size`` values, except where the source holds
    plain tuples (0.19.8 ``_save_moe_checkpoint`` passes the state through ``clone_tensors_for_torch_save``,
    which rebuilds every tuple, ``torch.Size`` included, as a tuple)."""
    from .writers.torch_stream import Size

    as_tuple = isinstance(like, list) and any(
        isinstance(g, Mapping) and any(type(v) is tuple for v in g.values()) for g in like)
    return [OrderedDict((n, tuple(s) if as_tuple else Size(s)) for n, s in group) for group in plan.param_shapes]


def default_workers() -> int:
    """Target files :func:`run_reshard` writes at once when not told: half the cores (each file has
    a writer and a reader thread), at most 8; 1 on a 2-core machine."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _write_files(plan: ReshardPlan, tag_dir: Path, cache: Any, *, workers: int,
                 writeback: bool = True) -> Iterator[Path]:
    """Write every target file, ``workers`` at a time; yields their paths in plan order. Not fsync'd
    here: :func:`run_reshard` fsyncs them all at once while it verifies."""
    from .writers.torch_stream import write_torch_tree

    # Every tree is built here, in the calling thread (the file cache is not thread-safe); writing one
    # reads only the byte ranges its tree names.
    jobs: list[tuple[Path, Any]] = []
    if plan.zero_stage in (0, 1, 2):
        for src in plan.source_model_files:
            tree = dict(cache.tree(src))
            tree["dp_world_size"] = plan.world_size
            if plan.zero_stage:
                tree["param_shapes"] = _shapes_tree(plan, tree.get("param_shapes"))
            jobs.append((tag_dir / src.name, tree))
        for src in plan.copied_model_files:
            jobs.append((tag_dir / src.name, dict(cache.tree(src))))
    if plan.zero_stage in (1, 2):
        src0 = cache.tree(plan.source_optim_files[0])
        for r in plan.ranks:
            assert r.optim_file is not None
            jobs.append((tag_dir / r.optim_file, _zero12_optim_tree(plan, r, src0, cache)))
    if plan.zero_stage == 3:
        src_models = [cache.tree(p) for p in plan.source_model_files]
        src0 = cache.tree(plan.source_optim_files[0])
        for r in plan.ranks:
            assert r.model_file is not None and r.optim_file is not None
            jobs.append((tag_dir / r.model_file, _zero3_model_tree(plan, r, src_models, cache)))
            jobs.append((tag_dir / r.optim_file, _zero3_optim_tree(plan, r, src0, cache)))
    if workers <= 1 or len(jobs) <= 1:
        for path, tree in jobs:
            yield write_torch_tree(path, tree, fsync=False, writeback=writeback)
        return
    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="dsckpt-write") as pool:
        futures = [pool.submit(write_torch_tree, path, tree, fsync=False, writeback=writeback) for path, tree in jobs]
        try:
            for fut in futures:
                yield fut.result()
        finally:  # on an error: start no other file; the pool waits for those being written
            for fut in futures:
                fut.cancel()


def _zero12_optim_tree(plan: ReshardPlan, r: RankPlan, src0: Mapping[str, Any], cache: Any) -> dict[str, Any]:
    osd0 = src0[OSD]
    base0 = osd0["base_optimizer_state"]
    state_keys = sorted(base0["state"].keys())
    state: dict[Any, Any] = {}
    for g in r.groups:
        src_state = base0["state"][state_keys[g.group]]
        new = {}
        for k, v in src_state.items():
            new[k] = (_streamed(g.exp_avg, cache) if k == "exp_avg" else
                      _streamed(g.exp_avg_sq, cache) if k == "exp_avg_sq" else _own_copy(v))
        state[state_keys[g.group]] = new
    osd = dict(osd0)
    osd["base_optimizer_state"] = {**base0, "state": state}
    osd["single_partition_of_fp32_groups"] = [_streamed(g.master, cache) for g in r.groups]
    osd["group_paddings"] = [g.padding_numel for g in r.groups]
    osd["partition_count"] = [g.partition_count or plan.world_size for g in r.groups]
    # param_alignment_paddings is absent from the files of DeepSpeed 0.10.3-0.18.9 (seen in 0.10.3, 0.12.6, 0.14.5,
    # 0.16.9, 0.18.9), whose loaders never look for it: write it only where the source has it.
    if "param_alignment_paddings" in osd0:
        osd["param_alignment_paddings"] = [list(p) for p in plan.alignment_paddings]
    osd["param_slice_mappings"] = [OrderedDict((n, _fragment_address(numel, start))
                                               for n, start, numel in g.slice_mappings) for g in r.groups]
    return {**src0, OSD: osd}


def _zero3_model_tree(plan: ReshardPlan, r: RankPlan, src_models: Sequence[Mapping[str, Any]],
                      cache: Any) -> dict[str, Any]:
    # Stage-3 ranks keep their own buffers (BatchNorm statistics are not synchronised): a rank that
    # existed before keeps its file's, a new rank starts from rank 0's.
    source_rank = r.rank if r.rank < len(src_models) else 0
    tree = dict(src_models[source_rank])
    if r.rank > 0 and source_rank == 0:
        tree["shared_params"] = {}  # DeepSpeed computes shared_params on rank 0 only (engine.py:5490-5528)
    tree["dp_world_size"] = plan.world_size
    tree["param_shapes"] = _shapes_tree(plan)
    if tree.get("frozen_param_fragments") is not None or r.frozen_fragments:
        tree["frozen_param_fragments"] = OrderedDict((n, _streamed(spec, cache)) for n, spec in r.frozen_fragments)
    return tree


def _zero3_optim_tree(plan: ReshardPlan, r: RankPlan, src0: Mapping[str, Any], cache: Any) -> dict[str, Any]:
    osd0 = src0[OSD]
    inner0 = osd0[OSD]
    src_state = inner0["state"]
    first_state = src_state[sorted(src_state.keys())[0]] if src_state else {}
    state: dict[Any, Any] = {}
    for g in r.groups:
        new = {}
        for k, v in first_state.items():
            new[k] = (_streamed(g.exp_avg, cache) if k == "exp_avg" else
                      _streamed(g.exp_avg_sq, cache) if k == "exp_avg_sq" else _own_copy(v))
        state[g.group] = new
    param_groups = []
    for gi, pg in enumerate(inner0["param_groups"]):
        param_groups.append({**pg, "params": [t for t, owner in enumerate(plan.subgroup_to_group) if owner == gi]})
    osd = dict(osd0)
    osd["partition_count"] = plan.world_size
    osd[OSD] = {**inner0, "state": state, "param_groups": param_groups}
    osd["fp32_flat_groups"] = [_streamed(g.master, cache, {"ds_id": g.ds_id} if g.ds_id is not None else None)
                               for g in r.groups]
    return {**src0, OSD: osd}


VERIFY_WINDOW_NUMEL = 64  # elements compared around each fragment boundary (quick verification)
VERIFY_SAMPLES = 8  # evenly spaced windows per stored copy (quick verification)
VERIFY_CHUNK_NBYTES = 8 << 20  # full verification compares this much at a time


def _verify(plan: ReshardPlan, new_root: Path, src_cache: Any, *, full: bool) -> int:
    """Re-open the output and compare every stored copy of every tensor with the source.

    Quick: windows of values around every fragment boundary of both sides (where a wrong offset or
    length would show), at both ends, and at evenly spaced points. Full: every value. Values are
    compared as bytes (bit for bit; NaN equals NaN). Returns the number of copies compared.
    """
    from .readers import FileCache, read_checkpoint
    from .writers.torch_stream import element_nbytes

    src = read_checkpoint(plan.source_root, tag=plan.tag, cache=src_cache)
    new_cache = FileCache()
    new = read_checkpoint(new_root, tag=plan.tag, cache=new_cache)
    if new.dp_world_size != plan.world_size:
        raise CorruptCheckpointError(
            f"verification failed: the written checkpoint records dp_world_size={new.dp_world_size}, "
            f"expected {plan.world_size}; nothing was written")
    src_entries = _entries_by_name(src)
    new_entries = _entries_by_name(new)
    if set(src_entries) != set(new_entries):
        diff = sorted(set(src_entries) ^ set(new_entries))
        raise CorruptCheckpointError(f"verification failed: tensors differ between input and output: {diff[:5]}")
    reader = _ByteReader()
    problems: list[str] = []
    checked = 0
    try:
        for name, e in src_entries.items():
            if e.tied_to is not None:
                continue
            n = new_entries[name]
            if n.shape != e.shape:
                problems.append(f"'{name}' has shape {list(n.shape)}, expected {list(e.shape)}")
                continue
            for role in (Role.MASTER, Role.EXP_AVG, Role.EXP_AVG_SQ, Role.MODULE):
                a, b = e.piece(role), n.piece(role)
                if a is None or b is None:
                    if (a is None) != (b is None) and role is not Role.MODULE:
                        problems.append(f"'{name}' lost its {role.value} copy")
                    continue
                if a.dtype != b.dtype or a.numel != b.numel:
                    problems.append(f"'{name}' ({role.value}) is {b.dtype}[{b.numel}], expected {a.dtype}[{a.numel}]")
                    continue
                item = element_nbytes(a.dtype)
                if full:
                    step = max(1, VERIFY_CHUNK_NBYTES // item)
                    windows = [(lo, min(step, a.numel - lo)) for lo in range(0, a.numel, step)]
                else:
                    windows = _sample_windows(a, b)
                for lo, numel in windows:
                    if reader.read(a, lo, numel, item, src_cache) != reader.read(b, lo, numel, item, new_cache):
                        problems.append(f"'{name}' ({role.value}) differs in elements [{lo}, {lo + numel})")
                        break
                checked += 1
    finally:
        reader.close()
    if problems:
        raise CorruptCheckpointError(
            "verification failed: " + "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)"
                                                                   if len(problems) > 10 else "")
            + ". Nothing was written. This is a dsckpt bug: please report it")
    return checked


def _sample_windows(a: Piece, b: Piece) -> list[tuple[int, int]]:
    """Element windows ``(start, numel)`` to compare for a quick verification of ``a`` vs ``b``."""
    total = a.numel
    w = VERIFY_WINDOW_NUMEL
    points = {0, total}
    points.update(f.dst_offset for f in a.fragments)
    points.update(f.dst_offset for f in b.fragments)
    points.update(total * k // (VERIFY_SAMPLES + 1) for k in range(1, VERIFY_SAMPLES + 1))
    spans = sorted((max(0, p - w // 2), min(total, p + w // 2)) for p in points)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


class _ByteReader:
    """Raw bytes of element ranges of a piece, read through :meth:`TensorRef.read_numpy` (``pread``,
    CRC-checked, no torch) for contiguous refs."""

    def close(self) -> None:
        pass

    def read(self, piece: Piece, start: int, numel: int, item: int, cache: Any) -> bytes:
        out = bytearray()
        end = start + numel
        for f in sorted(piece.fragments, key=lambda f: f.dst_offset):
            lo, hi = max(start, f.dst_offset), min(end, f.dst_offset + f.numel)
            if lo >= hi:
                continue
            ref = cache.tensor(f.file, f.key)
            first = f.src_offset + (lo - f.dst_offset)
            if not ref.is_contiguous():
                t = ref.read(first, hi - lo)
                out += t.reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
                continue
            if first + (hi - lo) > ref.numel or ref.storage_offset + first + (hi - lo) > ref.storage.numel:
                raise CorruptCheckpointError(f"{f.file}: {_fmt_key(f.key)} is shorter than its metadata says")
            out += ref.read_numpy(first, hi - lo).data.cast("B")
        return bytes(out)
