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
import json
import logging
import math
import os
import shutil
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .ds_writers import (
    LayoutPlan,
    SourceFacts,
    Target,
    build_jobs,
    plan_layout,
    source_layout_stage,
)
from .ds_writers.common import fmt_key as _fmt_key
from .ds_writers.moe import held_by_ep_rank_0
from .ds_writers.plan import rank_of as _rank_of
from .ds_writers.universal import UniversalPlan
from .errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError
from .hf import HfFilesPlan, copy_files, plan_resume_files
from .model import Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from .partition import DEFAULT_SUB_GROUP_SIZE

__all__ = [
    "ReshardPlan",
    "ReshardResult",
    "UniversalPlan",
    "compare_checkpoints",
    "plan_universal_reshard",
    "run_universal",
    "SourceFacts",
    "Target",
    "Verify",
    "default_workers",
    "describe_plan",
    "describe_target_config",
    "output_nbytes_bound",
    "plan_reshard",
    "read_source_facts",
    "run_reshard",
]

logger = logging.getLogger(__name__)

OSD = "optimizer_state_dict"
ADAM_STATE_KEYS = frozenset({"step", "exp_avg", "exp_avg_sq"})
SUPPORTED_OPTIMIZERS = frozenset({"adam", "adamw"})
ZERO_TO_FP32_SCRIPTS = ("zero_to_fp32.py", "zero_to_torch.py")


# --------------------------------------------------------------------------------------------
# The plan


ReshardPlan = LayoutPlan
"""The plan :func:`run_reshard` carries out (a :class:`~dsckpt.ds_writers.LayoutPlan`)."""


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

    if source_layout_stage(ckpt) == 0:
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
    if ckpt.layout.startswith("universal"):
        problems.append("a DeepSpeed universal checkpoint, which DeepSpeed loads on any rank count with "
                        "load_universal; it is read (info, to-fp32, scan), not rewritten")
    return problems


def _refusal_message(ckpt: LogicalCheckpoint, problems: list[str]) -> str:
    return (f"cannot reshard '{ckpt.tag_dir}': found " + "; ".join(problems)
            + ". dsckpt reshard supports data-parallel ZeRO 0-3 checkpoints trained with Adam/AdamW")


# --------------------------------------------------------------------------------------------
# Planning (pure)

def _entries_by_name(ckpt: LogicalCheckpoint) -> dict[str, TensorEntry]:
    return {e.name: e for e in ckpt.entries}


def _derive_facts(ckpt: LogicalCheckpoint) -> SourceFacts:
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


def plan_reshard(ckpt: LogicalCheckpoint, world_size: int, *, zero_stage: int | None = None,
                 sub_group_size: int | None = None, facts: SourceFacts | None = None,
                 hf_files: bool = True) -> ReshardPlan:
    """Decide every byte range of the checkpoint resharded to ``world_size`` ranks and ZeRO stage
    ``zero_stage`` (default: the source's). No tensor I/O.

    ``sub_group_size``: ZeRO-3 target sub-groups (default: the source's at stage 3, else DeepSpeed's
    default). ``facts`` comes from :func:`read_source_facts`; without it, it is derived from ``ckpt``
    and its ``ds_config`` (enough for tests; stage-3 sub-groups are then assumed to be one per param
    group). When the save dir is a Hugging Face Trainer folder (``checkpoint-N/``) and ``hf_files``,
    the plan also carries the Trainer's files into OUT (:func:`dsckpt.hf.plan_resume_files`: names
    listed from the folder, nothing opened), RNG states mapped to the new rank count.
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise UsageError(f"--world-size must be a positive integer, got {world_size!r}")
    if zero_stage is not None and zero_stage not in (0, 1, 2, 3):
        raise UsageError(f"--zero-stage must be 1, 2 or 3, got {zero_stage!r}")
    if sub_group_size is not None and (not isinstance(sub_group_size, int) or sub_group_size < 1):
        raise UsageError(f"--sub-group-size must be a positive integer, got {sub_group_size!r}")
    problems = _refusals_from_logical(ckpt)
    if problems:
        raise UnsupportedCheckpointError(_refusal_message(ckpt, problems))
    facts = facts if facts is not None else _derive_facts(ckpt)
    stage = source_layout_stage(ckpt) if zero_stage is None else zero_stage
    if sub_group_size is not None and stage != 3:
        raise UsageError("--sub-group-size applies to a ZeRO-3 target only; add --zero-stage 3")
    optim = tuple(p for p in ckpt.files if "optim_states" in p.name)
    common: dict[str, Any] = dict(
        source_root=ckpt.root, source_tag_dir=ckpt.tag_dir, tag=ckpt.tag, layout=ckpt.layout,
        precision=ckpt.precision, source_world_size=ckpt.dp_world_size, world_size=world_size,
        source_optim_files=tuple(sorted(optim, key=_rank_of)),
        bf16_prefixed_optim=any(p.name.startswith("bf16_") for p in optim),
        hf_files=_plan_hf_files(ckpt, world_size) if hf_files else None,
    )
    return plan_layout(ckpt, Target(stage, world_size, sub_group_size=sub_group_size), facts, common)



def _plan_hf_files(ckpt: LogicalCheckpoint, world_size: int) -> HfFilesPlan | None:
    from .layout import list_tags

    return plan_resume_files(ckpt.root, world_size, tag=ckpt.tag,
                             tag_dirs=frozenset(list_tags(ckpt.root)) | {ckpt.tag})


def describe_plan(plan: ReshardPlan, *, max_copies: int = 6) -> list[str]:
    """Human-readable lines: per target rank and group, sizes, padding and source ranges."""
    lines = [
        f"reshard {plan.source_tag_dir} (ZeRO stage {plan.from_stage}, {plan.precision.value}, "
        f"{plan.from_wrapper}) from {plan.source_world_size} to {plan.world_size} ranks"
        + (f", to ZeRO stage {plan.zero_stage} ({plan.optimizer_wrapper})" if plan.changes_layout else "")
        + f", tag '{plan.tag}'",
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
    if plan.changes_layout:
        lines.append("resume with: " + describe_target_config(plan))
    if plan.zero_stage == 0:
        lines.append("rewrite " + ", ".join(p.name for p in plan.source_model_files)
                     + f" with dp_world_size={plan.world_size}")
    if plan.hf_files is not None:
        lines.append(f"Hugging Face Trainer files from {plan.hf_files.folder} (byte for byte):")
        lines += plan.hf_files.describe()
    return lines


def describe_target_config(plan: ReshardPlan) -> str:
    """What the DeepSpeed config of the resumed run must hold for the files of ``plan`` to load."""
    z = {"stage": plan.zero_stage}
    if plan.zero_stage == 3:
        z["sub_group_size"] = plan.sub_group_size
    precision = {"bf16": '"bf16": {"enabled": true}', "fp16": '"fp16": {"enabled": true}'}.get(plan.precision.value)
    parts = [f'"zero_optimization": {json.dumps(z)}' + (f", {precision}" if precision else "")]
    if plan.zero_stage in (1, 2):
        rr = any(n.startswith("round_robin_gradients") for n in plan.notes)
        aligned = any(any(p) for p in plan.alignment_paddings)
        if rr or aligned:
            parts.append("with " + " and ".join(k for k, on in (("round_robin_gradients", rr),
                                                                  ("parameter_alignment", aligned)) if on) + " true")
    if plan.optimizer_wrapper == "BF16_Optimizer":
        parts.append('BF16_Optimizer: "data_types": {"grad_accum_dtype": "fp32"} at stage 1')
    elif plan.from_wrapper == "BF16_Optimizer":
        parts.append('no "data_types.grad_accum_dtype": "fp32" (that selects BF16_Optimizer)')
    if plan.from_stage == 3 and plan.zero_stage != 3:
        parts.append("gradient_clipping as you want it (ZeRO-3 files store no clip_grad)")
    elif plan.from_stage != 3 and plan.zero_stage == 3:
        parts.append("gradient_clipping as you want it (ZeRO-3 files store no clip_grad; the input's "
                     "optimizer files recorded one)")
    parts.append(f"train_batch_size for {plan.world_size} ranks")
    return "; ".join(parts)


# --------------------------------------------------------------------------------------------
# Doing it


class Verify(enum.Enum):
    """How :func:`run_reshard` checks what it wrote before moving it into place."""

    NONE = "none"
    QUICK = "quick"  # re-open every file; names, shapes, dtypes; sampled values of every stored copy
    FULL = "full"  # ... and every value of every stored copy, bit for bit


def run_reshard(plan: ReshardPlan, out: str | os.PathLike[str], *, cache: Any = None, force: bool = False,
                verify: Verify | str | bool = Verify.QUICK,
                on_file: Callable[[Path], None] | None = None, workers: int | None = None) -> ReshardResult:
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
    """
    from .atomic import atomic_dir, claim_output
    from .readers import FileCache

    mode = Verify.QUICK if verify is True else Verify.NONE if verify is False else Verify(verify)
    out = Path(out)
    src_root = plan.source_root.resolve()
    if out.resolve() == src_root or src_root in out.resolve().parents or out.resolve() in src_root.parents:
        raise UsageError(f"output '{out}' overlaps the input '{plan.source_root}'; choose a new folder")
    cache = cache if cache is not None else FileCache()
    written: list[Path] = []
    with claim_output(out, force=force, nbytes=output_nbytes_bound(plan)), atomic_dir(out) as tmp:
        tag_dir = tmp / plan.tag
        tag_dir.mkdir(parents=True)
        for f in _write_files(plan, tag_dir, cache, workers=default_workers() if workers is None else workers):
            written.append(f)
            if on_file is not None:
                on_file(f)
        (tmp / "latest").write_text(plan.tag, encoding="utf-8")
        for script in ZERO_TO_FP32_SCRIPTS:
            if (plan.source_root / script).is_file():
                shutil.copy2(plan.source_root / script, tmp / script)
        hf = copy_files(plan.hf_files, tmp) if plan.hf_files is not None else []
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
    if plan.from_stage == 3 and plan.zero_stage != 3:  # the module is rebuilt in full: at most fp32 per element
        model_nbytes += 4 * sum(math.prod(shape) for group in plan.param_shapes for _, shape in group)
        model_nbytes += sum(4 * spec.numel * plan.source_world_size for _, spec in plan.ranks[0].frozen_fragments) \
            if plan.ranks else 0
    scripts = sum(size(plan.source_root / s) for s in ZERO_TO_FP32_SCRIPTS)
    files = len(plan.source_model_files) + 2 * len(plan.ranks) + 3
    hf = plan.hf_files.nbytes if plan.hf_files is not None else 0
    files += len(plan.copied_model_files)
    return plan.copied_nbytes + model_nbytes + copied + scripts + hf + (64 << 10) * files


def default_workers() -> int:
    """Target files :func:`run_reshard` writes at once when not told: half the cores (each file has
    a writer and a reader thread), at most 8; 1 on a 2-core machine."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _write_files(plan: ReshardPlan, tag_dir: Path, cache: Any, *, workers: int) -> Iterator[Path]:
    """Write every target file, ``workers`` at a time; yields their paths in plan order."""
    from .readers import read_checkpoint
    from .writers.torch_stream import write_torch_tree

    # Every tree is built here, in the calling thread (the file cache is not thread-safe); writing one
    # reads only the byte ranges its tree names.
    ckpt = read_checkpoint(plan.source_root, tag=plan.tag, cache=cache)
    jobs = build_jobs(plan, ckpt, tag_dir, cache)
    if workers <= 1 or len(jobs) <= 1:
        for path, tree in jobs:
            yield write_torch_tree(path, tree)
        return
    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="dsckpt-write") as pool:
        futures = [pool.submit(write_torch_tree, path, tree) for path, tree in jobs]
        try:
            for fut in futures:
                yield fut.result()
        finally:  # on an error: start no other file; the pool waits for those being written
            for fut in futures:
                fut.cancel()


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

    src = read_checkpoint(plan.source_root, tag=plan.tag, cache=src_cache)
    new_cache = FileCache()
    new = read_checkpoint(new_root, tag=plan.tag, cache=new_cache)
    if new.dp_world_size != plan.world_size:
        raise CorruptCheckpointError(
            f"verification failed: the written checkpoint records dp_world_size={new.dp_world_size}, "
            f"expected {plan.world_size}; nothing was written")
    if (source_layout_stage(new), new.optimizer_wrapper) != (plan.zero_stage, plan.optimizer_wrapper):
        raise CorruptCheckpointError(
            f"verification failed: the written checkpoint reads as ZeRO stage {source_layout_stage(new)} "
            f"({new.optimizer_wrapper}), expected {plan.zero_stage} ({plan.optimizer_wrapper}); nothing was written")
    return compare_checkpoints(src, src_cache, new, new_cache, full=full)


def compare_checkpoints(src: LogicalCheckpoint, src_cache: Any, new: LogicalCheckpoint, new_cache: Any, *,
                        full: bool) -> int:
    """Compare every stored copy (master, moments, module) of every tensor of ``new`` with ``src``
    (quick: sampled windows, full: every value); raise :class:`CorruptCheckpointError` listing what
    differs. Returns the number of copies compared."""
    from .writers.torch_stream import element_nbytes

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


# --------------------------------------------------------------------------------------------
# Universal checkpoint folders (reshard --universal)


def plan_universal_reshard(ckpt: LogicalCheckpoint, facts: SourceFacts | None = None) -> UniversalPlan:
    """Plan DeepSpeed's universal folder for ``ckpt`` (:mod:`dsckpt.ds_writers.universal`). Pure.
    ``facts`` (from :func:`read_source_facts`) is only taken as proof that the refusals ran."""
    from .ds_writers.universal import plan_universal

    optim = tuple(sorted((p for p in ckpt.files if "optim_states" in p.name), key=_rank_of))
    stage = source_layout_stage(ckpt)
    if stage == 3:
        models = tuple(sorted((p for p in ckpt.files if p.name.startswith("zero_pp_rank_")
                               and p.name.endswith("_model_states.pt")), key=_rank_of))
    else:
        models = tuple(p for p in ckpt.files if p.name == "mp_rank_00_model_states.pt")
    return plan_universal(ckpt, source_stage=stage, optimizer_files=optim, model_files=models)


def run_universal(plan: UniversalPlan, out: str | os.PathLike[str], *, cache: Any = None, force: bool = False,
                  verify: Verify | str | bool = Verify.QUICK, on_file: Callable[[Path], None] | None = None,
                  workers: int | None = None) -> ReshardResult:
    """Write ``plan`` as a new save dir ``out`` holding ``latest_universal`` and the universal folder
    ``<tag>_universal/`` (what ``ds_to_universal --output_folder out/<tag>_universal`` leaves), streamed
    from byte ranges of the source files, re-read through :mod:`dsckpt.readers.universal` and compared
    with the source (as :func:`run_reshard` does) before it is moved into place."""
    from .atomic import atomic_dir, claim_output
    from .ds_writers.universal import universal_trees
    from .readers import FileCache, read_checkpoint
    from .writers.torch_stream import write_torch_tree

    mode = Verify.QUICK if verify is True else Verify.NONE if verify is False else Verify(verify)
    out = Path(out)
    src_root = plan.source_root.resolve()
    if out.resolve() == src_root or src_root in out.resolve().parents or out.resolve() in src_root.parents:
        raise UsageError(f"output '{out}' overlaps the input '{plan.source_root}'; choose a new folder")
    cache = cache if cache is not None else FileCache()
    models = sum(p.stat().st_size for p in plan.model_files)
    nbytes = plan.copied_nbytes + models + 4 * sum(1 for _ in plan.cast_files) + (64 << 10) * (
        len(plan.state_files) + len(plan.step_files) + len(plan.cast_files) + 2)
    written: list[Path] = []
    with claim_output(out, force=force, nbytes=nbytes), atomic_dir(out) as tmp:
        folder = tmp / plan.out_tag
        jobs = []
        for rel, tree in universal_trees(plan, cache):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / rel, tree))
        n = default_workers() if workers is None else workers
        if n <= 1:
            done = (write_torch_tree(p, t) for p, t in jobs)
        else:
            pool = ThreadPoolExecutor(min(n, len(jobs)), thread_name_prefix="dsckpt-write")
            done = (f.result() for f in [pool.submit(write_torch_tree, p, t) for p, t in jobs])
        try:
            for f in done:
                written.append(f)
                if on_file is not None:
                    on_file(f)
        finally:
            if n > 1:
                pool.shutdown(cancel_futures=True)
        (tmp / "latest_universal").write_text(plan.out_tag, encoding="utf-8")
        checked = 0
        if mode is not Verify.NONE:
            src = read_checkpoint(plan.source_root, tag=plan.tag, cache=cache)
            new_cache = FileCache()
            new = read_checkpoint(tmp, cache=new_cache)
            if (new.layout, new.dp_world_size, new.optimizer_step, new.global_steps) != (
                    f"universal from zero{src.zero_stage}", src.dp_world_size, src.optimizer_step, src.global_steps):
                raise CorruptCheckpointError(
                    f"verification failed: the written folder reads as {new.layout} ({new.dp_world_size} ranks, "
                    f"optimizer step {new.optimizer_step}, global step {new.global_steps}), expected universal from "
                    f"zero{src.zero_stage} ({src.dp_world_size}, {src.optimizer_step}, {src.global_steps}); nothing "
                    "was written. This is a dsckpt bug: please report it")
            checked = compare_checkpoints(src, cache, new, new_cache, full=mode is Verify.FULL)
            new_cache.finish_checks()
        cache.finish_checks()
    return ReshardResult(out, plan.out_tag, tuple(out / f.relative_to(tmp) for f in written), checked, mode.value)
