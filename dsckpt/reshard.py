"""``dsckpt reshard``: read -> plan for the target -> write -> verify.

A checkpoint is re-partitioned for a new data-parallel world size and, with ``zero_stage``, written
for another ZeRO stage (1, 2 and 3 from any of 1, 2, 3, ``BF16_Optimizer`` sources included):

1. **read**: :func:`dsckpt.readers.read_checkpoint` gives the logical checkpoint;
   :func:`~dsckpt.ds_writers.facts.read_source_facts` the few layout facts it does not hold, and
   refuses what cannot be written (tensor/pipeline parallel, NVMe offload, non-Adam optimizers);
2. **plan** (pure): :func:`plan_reshard`, three phases each done once (``docs/design.md``): describe the source
   (:func:`dsckpt.ds_writers.source.describe_source`), resolve the target against it in one table of what is
   allowed (:func:`dsckpt.ds_writers.target.resolve_target`), plan every file and every byte range in it
   (:func:`dsckpt.ds_writers.plan_layout`: the writer of the target layout, one module per DeepSpeed layout);
3. **write**: :func:`run_reshard` streams the trees of :func:`dsckpt.ds_writers.build_jobs` into a
   temporary save dir (``latest`` + the same tag, the ``zero_to_fp32.py`` copies, the Hugging Face
   Trainer files), torch-free byte copies with CRC checks, several files at once;
4. **verify**: :func:`dsckpt.ds_writers.readback.verify_written` re-opens the output through the
   readers and compares every stored copy with the source before the folder is moved into place
   atomically. The input is only read.
"""

from __future__ import annotations

import contextlib
import enum
import json
import logging
import math
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .atomic import copy_file
from .ds_writers import (
    LayoutPlan,
    SourceFacts,
    Target,
    build_jobs,
    plan_layout,
)
from .ds_writers.common import fmt_key as _fmt_key
from .ds_writers.facts import (
    ELASTIC_NOTE,
    read_source_facts,
)
from .ds_writers.plan import source_model_files
from .ds_writers.readback import compare_checkpoints, verify_written
from .ds_writers.source import describe_source
from .ds_writers.target import ReshardRequest, resolve_target
from .ds_writers.universal import UniversalPlan
from .errors import CorruptCheckpointError
from .hf import HfFilesPlan, copy_files, plan_resume_files
from .model import Kind, LogicalCheckpoint

__all__ = [
    "ReshardPlan",
    "ReshardResult",
    "SourceFacts",
    "Target",
    "UniversalPlan",
    "Verify",
    "default_workers",
    "describe_plan",
    "describe_target_config",
    "output_nbytes_bound",
    "plan_reshard",
    "plan_universal_reshard",
    "read_source_facts",
    "run_reshard",
    "run_reshard_distributed",
    "run_universal",
    "run_universal_distributed",
]

logger = logging.getLogger(__name__)

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


def plan_reshard(ckpt: LogicalCheckpoint, world_size: int, *, zero_stage: int | None = None,
                 sub_group_size: int | None = None, facts: SourceFacts | None = None,
                 hf_files: bool = True, tp_size: int | None = None, ep_size: int | None = None,
                 pp_size: int | None = None, partition_method: str | None = None, num_layers: int | None = None,
                 layer_types: Sequence[str] | None = None,
                 make_vocab_size_divisible_by: int | None = None, dtype: str | None = None,
                 loss_scale: float | None = None) -> ReshardPlan:
    """Decide every byte range of the checkpoint resharded to ``world_size`` ranks and ZeRO stage
    ``zero_stage`` (default: the source's). No tensor I/O.

    ``world_size`` counts every rank: ``tp_size`` tensor-parallel ranks (default: the source's) times ``pp_size``
    pipeline stages (default: the source's) times the data-parallel size, which is ``world_size / (tp_size *
    pp_size)``. Another stage count takes the stage boundaries ``PipelineModule`` computes with
    ``partition_method`` (default DeepSpeed's ``parameters``) over the layer list (``num_layers``, ``layer_types``:
    what the files do not state; :func:`dsckpt.pipeline_stages.plan_stages`). A TP size other than the source's and 1
    takes AutoTP's widths at that size (:mod:`dsckpt.autotp_widths`), whose key/value head count is read from the HF
    ``config.json`` in ``ckpt.root`` unless ``facts.autotp_meta`` gives it. A Megatron-style record splits every
    param in equal parts at the new size (:func:`dsckpt.tensor_parallel.megatron_layout`) and pads its vocabulary
    to a multiple of ``make_vocab_size_divisible_by`` x TP (default: the value the checkpoint's ``args`` record).

    ``sub_group_size``: ZeRO-3 target sub-groups (default: the source's at stage 3, else DeepSpeed's
    default). ``facts`` comes from :func:`read_source_facts`; without it, it is derived from ``ckpt``
    and its ``ds_config`` (enough for tests; stage-3 sub-groups are then assumed to be one per param
    group). When the save dir is a Hugging Face Trainer folder (``checkpoint-N/``) or an Accelerate
    ``save_state`` folder and ``hf_files``, the plan also carries their files into OUT
    (:func:`dsckpt.hf.plan_resume_files`: names listed from the folder, nothing opened), RNG states mapped to the new
    rank count.

    ``dtype`` (``fp32``, ``fp16``, ``bf16``; default the source's): the target's precision
    (:mod:`dsckpt.ds_writers.precision`); ``loss_scale``: an fp16 target's initial dynamic loss scale (default
    DeepSpeed's 2**16).
    """
    src = describe_source(ckpt, facts)  # 1. the source, described once (refuses what no target is written from)
    target = resolve_target(src, ReshardRequest(  # 2. every flag checked against it, the target decided
        world_size, zero_stage=zero_stage, sub_group_size=sub_group_size, tp_size=tp_size, ep_size=ep_size,
        pp_size=pp_size, partition_method=partition_method, num_layers=num_layers, layer_types=layer_types,
        vocab_divisor=make_vocab_size_divisible_by, dtype=dtype, loss_scale=loss_scale))
    changed = target.precision if target.precision.changed else None
    return plan_layout(src, target, dict(  # 3. the files, planned from both
        source_root=ckpt.root, source_tag_dir=ckpt.tag_dir, tag=ckpt.tag, layout=ckpt.layout,
        precision=src.precision, source_world_size=ckpt.dp_world_size, world_size=target.world_size,
        source_optim_files=src.optim_files, bf16_prefixed_optim=target.precision.bf16_prefix(src.bf16_prefixed_optim),
        hf_files=_plan_hf_files(ckpt, target.total_world_size) if hf_files else None, tied_keys=src.tied_keys,
        **({"precision_change": changed} if changed else {}),
        **({"notes": (*src.notes, *((changed.note(),) if changed else ()))} if src.notes or changed else {})))


def _plan_hf_files(ckpt: LogicalCheckpoint, world_size: int) -> HfFilesPlan | None:
    from .layout import list_tags

    return plan_resume_files(ckpt.root, world_size, tag=ckpt.tag,
                             tag_dirs=frozenset(list_tags(ckpt.root)) | {ckpt.tag})


def describe_plan(plan: ReshardPlan, *, max_copies: int = 6) -> list[str]:
    """Human-readable lines: per target rank and group, sizes, padding and source ranges."""
    sizes = [(k, a, b) for k, a, b in (("PP", plan.source_pp_size, plan.pp_size), ("TP", plan.source_tp_size,
                                                                                     plan.tp_size)) if a > 1 or b > 1]
    sizes.append(("DP", plan.source_world_size, plan.world_size))
    lines = [
        f"reshard {plan.source_tag_dir} (ZeRO stage {plan.from_stage}, {plan.precision.value}, "
        f"{plan.from_wrapper}) from {plan.source_total_world_size} to {plan.total_world_size} ranks"
        + (f" ({' x '.join(f'{k} {v}' for k, v, _ in sizes)} -> {' x '.join(f'{k} {v}' for k, _, v in sizes)})"
           if len(sizes) > 1 else "")
        + (f", to ZeRO stage {plan.zero_stage} ({plan.optimizer_wrapper})" if plan.changes_layout else "")
        + (f", to {plan.written_precision.value}" if plan.precision_change is not None else "")
        + f", tag '{plan.tag}'",
    ]
    lines += [f"note: {n}" for n in plan.notes]
    for r in (r for part in plan.parts() for r in part.ranks):
        files = ", ".join(f for f in (r.optim_file, r.model_file) if f)
        lines.append(f"rank {r.rank}: {files}")
        for g in r.groups:
            lines.append(f"  {plan.wording.group_label} {g.group}: partition {g.partition_numel} elements, padding "
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
    if plan.changes_layout or plan.precision_change is not None:
        lines.append("resume with: " + describe_target_config(plan))
    if plan.wording.model_states_line is not None:  # stage 0: one model-states file per model-parallel rank
        verb, remark = plan.wording.model_states_line
        lines.append(f"{verb} " + ", ".join(f"mp_rank_{part.mp_rank:02d}_model_states.pt" for part in plan.parts())
                     + f"{remark} with dp_world_size={plan.world_size}")
    if plan.hf_files is not None:
        lines.append(f"{plan.hf_files.client} files from {plan.hf_files.folder} (byte for byte):")
        lines += plan.hf_files.describe()
    return lines


def describe_target_config(plan: ReshardPlan) -> str:
    """What the DeepSpeed config of the resumed run must hold for the files of ``plan`` to load."""
    z: dict[str, int | None] = {"stage": plan.zero_stage}
    if plan.wording.config_sub_group_size:
        z["sub_group_size"] = plan.sub_group_size
    if plan.precision_change is not None:  # the precision block of the target's (ds_writers.precision)
        precision = plan.precision_change.config_block()
    else:
        precision = {"bf16": '"bf16": {"enabled": true}', "fp16": '"fp16": {"enabled": true}'}.get(
            plan.precision.value)
    parts = [f'"zero_optimization": {json.dumps(z)}' + (f", {precision}" if precision else "")]
    if plan.precision_change is not None and precision is None:
        parts.append('neither "bf16" nor "fp16" enabled (fp32)')
    if plan.wording.config_zero_flags:
        rr = any(n.startswith("round_robin_gradients") for n in plan.notes)
        aligned = any(any(p) for p in plan.alignment_paddings)
        elastic = ELASTIC_NOTE in plan.notes
        if rr or aligned or elastic:
            parts.append("with " + " and ".join(k for k, on in (("round_robin_gradients", rr),
                                                                  ("parameter_alignment", aligned),
                                                                  ("elastic_checkpoint", elastic)) if on) + " true")
    if plan.optimizer_wrapper == "BF16_Optimizer":
        parts.append('BF16_Optimizer: "data_types": {"grad_accum_dtype": "fp32"} at stage 1')
    elif plan.from_wrapper == "BF16_Optimizer":
        parts.append('no "data_types.grad_accum_dtype": "fp32" (that selects BF16_Optimizer)')
    parts += plan.wording.resume_notes  # gradient_clipping across ZeRO-3, a stage-0 pipeline's model_parameters
    dp = "data-parallel " if plan.tp_size > 1 else ""
    parts.append(f"train_batch_size for {plan.world_size} {dp}rank{'s' if plan.world_size != 1 else ''}")
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

    mode, out, cache = _prepare(plan.source_root, out, verify, cache)
    written: list[Path] = []
    with claim_output(out, force=force, nbytes=output_nbytes_bound(plan)), atomic_dir(out, fsync=fsync) as tmp:
        tag_dir = tmp / plan.tag
        tag_dir.mkdir(parents=True)
        for f in _write_files(plan, tag_dir, cache, workers=default_workers() if workers is None else workers,
                              writeback=fsync):
            written.append(f)
            if on_file is not None:
                on_file(f)
        hf = _finish_save_dir(plan, tmp)
        with background_fsync(tmp, enabled=fsync):  # the disk finishes the write-back while we verify
            checked = _verify_save_dir(plan, tmp, cache, mode)
            cache.finish_checks()  # CRC-32s of source records read only partly; a mismatch leaves no output
    return ReshardResult(out, plan.tag, tuple(out / plan.tag / f.name for f in written), checked, mode.value,
                         tuple(out / f.relative_to(tmp) for f in hf))


def run_reshard_distributed(plan: ReshardPlan, out: str | os.PathLike[str], group: Any, *, cache: Any = None,
                            force: bool = False, verify: Verify | str | bool = Verify.QUICK,
                            on_file: Callable[[Path], None] | None = None, workers: int | None = None,
                            fsync: bool = True) -> ReshardResult:
    """:func:`run_reshard` spread over the ranks of ``group`` (:class:`dsckpt.distributed.Group`): the
    target files are split over the ranks by bytes (:func:`dsckpt.distributed.split_by_nbytes`); each rank
    writes its files into rank 0's leased temporary folder, fsyncs them and reports their sizes; every
    source record's CRC-32 is completed once, by the rank owning its file; rank 0 checks the reported
    sizes against the filesystem, writes ``latest``, the scripts and the Trainer files, runs ``verify``
    over the whole output (on rank 0 alone, for now) and renames OUT into place. Same bytes as
    :func:`run_reshard`; OUT appears only if every rank succeeded."""
    from .readers import read_checkpoint

    mode, out, cache = _prepare(plan.source_root, out, verify, cache)
    group.agree({"plan": describe_plan(plan, max_copies=1 << 30), "out": str(out), "tag": plan.tag,
                 "verify": mode.value}, "the reshard plan")
    ckpt = read_checkpoint(plan.source_root, tag=plan.tag, cache=cache, tied_keys=dict(plan.tied_keys))

    def finish(tmp: Path) -> tuple[int, list[str]]:
        hf = _finish_save_dir(plan, tmp)
        return _verify_save_dir(plan, tmp, cache, mode), [str(f.relative_to(tmp)) for f in hf]

    rels, (checked, hf) = _run_distributed(
        group, out, cache, force=force, fsync=fsync, workers=workers, on_file=on_file,
        nbytes=lambda: output_nbytes_bound(plan), folders=[Path(plan.tag)],
        jobs=lambda tmp: build_jobs(plan, ckpt, tmp / plan.tag, cache), finish=finish)
    return ReshardResult(out, plan.tag, tuple(out / r for r in rels), checked, mode.value,
                         tuple(out / f for f in hf))


def _finish_save_dir(plan: ReshardPlan, tmp: Path) -> list[Path]:
    """``latest``, the ``zero_to_fp32.py`` copies and the plan's Trainer files beside the written tag folder; the
    Trainer files copied."""
    (tmp / "latest").write_text(plan.tag, encoding="utf-8")
    for script in ZERO_TO_FP32_SCRIPTS:
        if (plan.source_root / script).is_file():
            copy_file(plan.source_root / script, tmp / script)
    return copy_files(plan.hf_files, tmp) if plan.hf_files is not None else []


def _verify_save_dir(plan: ReshardPlan, tmp: Path, cache: Any, mode: Verify) -> int:
    return 0 if mode is Verify.NONE else verify_written(plan, tmp, cache, full=mode is Verify.FULL)


def _run_distributed(group: Any, out: Path, cache: Any, *, force: bool, fsync: bool, workers: int | None,
                     on_file: Callable[[Path], None] | None, nbytes: Callable[[], int], folders: Sequence[Path],
                     jobs: Callable[[Path], list[tuple[Path, Any]]], finish: Callable[[Path], Any]
                     ) -> tuple[list[str], Any]:
    """The steps of a ``--distributed`` write, for a reshard and a universal folder alike: rank 0 claims ``out``
    and opens its leased temporary folder (:func:`_claim_leased`, ``folders`` made in it); every rank builds the
    ``jobs(tmp)`` trees (reading only pickles), writes its share of them split by bytes
    (:func:`dsckpt.distributed.split_by_nbytes`), fsyncs them and reports their sizes; every source record's CRC-32
    is completed once, by the rank owning its file; rank 0 checks the reported sizes against the filesystem, runs
    ``finish(tmp)`` (the files beside them and the verification, on rank 0 alone for now) and renames OUT into
    place. Returns the written files' paths relative to OUT and rank 0's ``finish`` result; OUT appears only if
    every rank succeeded."""
    from . import crc
    from .distributed import export_segments, owned_checks, record_checks, split_by_nbytes

    checks = record_checks(cache)
    workers = default_workers() if workers is None else workers
    with contextlib.ExitStack() as stack:
        tmp = _claim_leased(group, stack, out, force=force, nbytes=nbytes, fsync=fsync, folders=folders)
        todo = jobs(tmp)
        rels = [str(path.relative_to(tmp)) for path, _ in todo]
        mine = split_by_nbytes([_tree_nbytes(tree) for _, tree in todo], group.world_size)[group.rank]

        def write() -> tuple[dict[str, int], Any]:
            sizes: dict[str, int] = {}
            # make_parent=False: a rank must not bring back the folder rank 0 removed after a failure
            for f in _write_jobs([todo[i] for i in mine], workers, writeback=fsync, make_parent=False):
                if fsync:  # this rank's writes reach the disk before rank 0 renames OUT
                    fd = os.open(f, os.O_RDONLY)
                    try:
                        os.fsync(fd)
                    finally:
                        os.close(fd)
                sizes[str(f.relative_to(tmp))] = f.stat().st_size
                if on_file is not None:
                    on_file(f)
            return sizes, export_segments(checks)

        results = group.step(write, "writing OUT")
        group.step(lambda: crc.finish(owned_checks(checks, [r[1] for r in results], group)),
                   "the CRC-32 checks of the input")
        reported = {k: v for r in results for k, v in r[0].items()}

        def check_and_finish() -> Any:
            if not group.is_root:
                return None
            wrong = [f"{r}: reported {reported.get(r)} bytes, on disk "
                     f"{(tmp / r).stat().st_size if (tmp / r).exists() else None}"
                     for r in rels if reported.get(r) is None or not (tmp / r).exists()
                     or (tmp / r).stat().st_size != reported[r]]
            if wrong:
                raise CorruptCheckpointError(f"'{out}' was not written completely ({'; '.join(wrong)}); nothing was "
                                             "moved into place")
            return finish(tmp)

        done = group.step(check_and_finish, "checking OUT")[0]
        group.step(lambda: stack.close() if group.is_root else None, "moving OUT into place")
    return rels, done


def _claim_leased(group: Any, stack: contextlib.ExitStack, out: Path, *, force: bool, nbytes: Callable[[], int],
                  fsync: bool, folders: Sequence[Path]) -> Path:
    """The claim step of a ``--distributed`` reshard: rank 0 claims ``out`` (:func:`dsckpt.atomic.claim_output`)
    and opens its leased temporary folder (:func:`dsckpt.atomic.atomic_dir`), both held on ``stack`` (closing it
    renames the folder into place, or removes it after a failure), and makes ``folders`` (relative) in it.
    ``nbytes()`` (the free-space check) runs on rank 0 alone, inside the step, so its failure reaches every rank.
    Every rank gets the temporary folder's path."""
    from .atomic import atomic_dir, claim_output

    def claim() -> str | None:
        if not group.is_root:
            return None
        stack.enter_context(claim_output(out, force=force, nbytes=nbytes()))
        tmp = stack.enter_context(atomic_dir(out, fsync=fsync, leased=True))
        for folder in folders:
            (tmp / folder).mkdir(parents=True, exist_ok=True)
        return str(tmp)

    return Path(group.step(claim, "claiming OUT")[0])


def _tree_nbytes(tree: Any) -> int:
    """Tensor bytes a target file's tree will stream (for splitting files over ranks); at least 1."""
    total = 0
    todo = [tree]
    seen: set[int] = set()  # the writer pickles a shared object once: count it once, look it up first
    while todo:
        x = todo.pop()
        if id(x) in seen:
            continue
        seen.add(id(x))
        if isinstance(x, dict):
            todo.extend(x.values())
        elif isinstance(x, (list, tuple)):
            todo.extend(x)
        else:
            n = getattr(x, "nbytes", None)
            if isinstance(n, int):
                total += n
    return max(1, total)


def output_nbytes_bound(plan: ReshardPlan) -> int:
    """An upper estimate of what :func:`run_reshard` writes, for the free-space check: the flat
    partitions, the model-states files (one per target rank at stage 3), the scripts, and 64 KiB of
    pickle and zip records per file."""
    def size(p: Path) -> int:
        try:
            return p.stat().st_size
        except OSError:
            return 0

    if plan.mp_ranks:
        # re-cut layer files: per target TP rank at most the full module (source TP ranks x TP rank 0's bytes, the
        # padded vocabulary's growth counted twice over)
        layers = 2 * plan.source_tp_size * sum(size(p) + (64 << 10) for p in plan.recut_layer_files) * max(
            1, -(-plan.tp_size // plan.source_tp_size))
        return (sum(output_nbytes_bound(p) for p in plan.mp_ranks) + (plan.hf_files.nbytes if plan.hf_files else 0)
                + layers)
    models = [size(p) for p in plan.source_model_files]
    copied = sum(size(p) for p in plan.copied_model_files)
    sizes = plan.wording
    model_nbytes = max(models, default=0) * plan.world_size if sizes.model_files_per_rank else sum(models)
    if sizes.module_rebuilt:  # the module is rebuilt in full from a ZeRO-3 source: at most fp32 per element
        model_nbytes += 4 * sum(math.prod(shape) for group in plan.param_shapes for _, shape in group)
    if sizes.optimizer_into_model_states:  # the optimizer state moves into the model states and (native
        # MoE) into one expp_rank_* file per expert-parallel rank, fewer than the expert files: master and up to 4
        # states, fp32, per element
        files = 1 + len(plan.copied_model_files)
        model_nbytes += 20 * files * sum(math.prod(shape) for group in plan.param_shapes for _, shape in group)
        model_nbytes += sum(4 * spec.numel * plan.source_world_size for _, spec in plan.ranks[0].frozen_fragments) \
            if plan.ranks else 0
    scripts = sum(size(plan.source_root / s) for s in ZERO_TO_FP32_SCRIPTS)
    files = len(plan.source_model_files) + 2 * len(plan.ranks) + 3
    hf = plan.hf_files.nbytes if plan.hf_files is not None else 0
    files += len(plan.copied_model_files)
    return plan.copied_nbytes + model_nbytes + copied + scripts + hf + (64 << 10) * files


def _prepare(source_root: Path, out: str | os.PathLike[str], verify: Verify | str | bool,
             cache: Any) -> tuple[Verify, Path, Any]:
    """The verification mode, the output path (refused if it overlaps the input) and the file cache."""
    from .readers import FileCache

    mode = Verify.QUICK if verify is True else Verify.NONE if verify is False else Verify(verify)
    out = Path(out)
    from .atomic import refuse_overlap

    refuse_overlap(out, source_root, "choose a new folder")
    return mode, out, cache if cache is not None else FileCache()


def default_workers() -> int:
    """Target files :func:`run_reshard` writes at once when not told: half the cores (each file has
    a writer and a reader thread), at most 8; 1 on a 2-core machine."""
    return max(1, min(8, (os.cpu_count() or 1) // 2))


def _write_files(plan: ReshardPlan, tag_dir: Path, cache: Any, *, workers: int,
                 writeback: bool = True) -> Iterator[Path]:
    """Write every target file, ``workers`` at a time; yields their paths in plan order."""
    from .readers import read_checkpoint

    # Every tree is built here, in the calling thread (the file cache is not thread-safe); writing one
    # reads only the byte ranges its tree names.
    ckpt = read_checkpoint(plan.source_root, tag=plan.tag, cache=cache, tied_keys=dict(plan.tied_keys))
    yield from _write_jobs(build_jobs(plan, ckpt, tag_dir, cache), workers, writeback=writeback)


def _write_jobs(jobs: list[tuple[Path, Any]], workers: int, *, writeback: bool = True,
                make_parent: bool = True) -> Iterator[Path]:
    """Write ``(path, tree)`` jobs, ``workers`` at a time; yields the paths in order. Not fsync'd here:
    the caller fsyncs them all at once while it verifies (:func:`~dsckpt.atomic.background_fsync`);
    ``writeback``: start the kernel's write-back while writing (only useful when an fsync follows)."""
    from .nvme_swap import SWAP_SUFFIX
    from .writers.raw import write_raw_tensor
    from .writers.torch_stream import write_torch_tree

    def write(path: Path, tree: Any) -> Path:
        if path.name.endswith(SWAP_SUFFIX):  # an NVMe swap file: the tensor's bytes, no container
            return write_raw_tensor(path, tree, fsync=False, make_parent=make_parent)
        return write_torch_tree(path, tree, fsync=False, writeback=writeback, make_parent=make_parent)

    if workers <= 1 or len(jobs) <= 1:
        for path, tree in jobs:
            yield write(path, tree)
        return
    with ThreadPoolExecutor(min(workers, len(jobs)), thread_name_prefix="dsckpt-write") as pool:
        futures = [pool.submit(write, path, tree) for path, tree in jobs]
        try:
            for fut in futures:
                yield fut.result()
        finally:  # on an error: start no other file; the pool waits for those being written
            for fut in futures:
                fut.cancel()


# --------------------------------------------------------------------------------------------
# Universal checkpoint folders (reshard --universal)


def plan_universal_reshard(ckpt: LogicalCheckpoint, facts: SourceFacts | None = None) -> UniversalPlan:
    """Plan DeepSpeed's universal folder for ``ckpt`` (:mod:`dsckpt.ds_writers.universal`). Pure. The same three
    phases as :func:`plan_reshard`: the source described (its universal-target refusals are the folder's own), the
    target resolved (:func:`dsckpt.ds_writers.target.resolve_universal`; a stage-0 source is written as the folder of
    the ZeRO-1 files of the same size, planned by :func:`plan_reshard` from ``facts``), the folder's refusals
    (:data:`~dsckpt.ds_writers.target.UNIVERSAL_RULES`), the folder planned
    (:func:`dsckpt.ds_writers.universal.plan_universal`). ``facts`` (from :func:`read_source_facts`) is otherwise
    only taken as proof that the refusals ran."""
    from .ds_writers.target import refuse_universal, resolve_universal
    from .ds_writers.universal import plan_universal

    src = describe_source(ckpt, facts, refuse=False)  # 1. (a universal target's refusals are its own rows)
    target = resolve_universal(src)  # 2.
    zero_layout = (plan_reshard(ckpt, target.zero1_world_size, zero_stage=1, facts=facts, hf_files=False)
                   if target.from_zero1 else None)
    refuse_universal(src, target)
    return plan_universal(ckpt, target, optimizer_files=src.optim_files, model_files=source_model_files(ckpt),
                          zero_layout=zero_layout)  # 3.


def run_universal(plan: UniversalPlan, out: str | os.PathLike[str], *, cache: Any = None, force: bool = False,
                  verify: Verify | str | bool = Verify.QUICK, on_file: Callable[[Path], None] | None = None,
                  workers: int | None = None, fsync: bool = True) -> ReshardResult:
    """Write ``plan`` as a new save dir ``out`` holding ``latest_universal`` and the universal folder
    ``<tag>_universal/`` (what ``ds_to_universal --output_folder out/<tag>_universal`` leaves), streamed
    from byte ranges of the source files, re-read through :mod:`dsckpt.readers.universal` and compared
    with the source (as :func:`run_reshard` does) before it is moved into place. ``fsync``: as for
    :func:`run_reshard`."""
    from .atomic import atomic_dir, background_fsync, claim_output
    from .ds_writers.universal import universal_trees

    mode, out, cache = _prepare(plan.source_root, out, verify, cache)
    nbytes = _universal_nbytes(plan)
    written: list[Path] = []
    with claim_output(out, force=force, nbytes=nbytes), atomic_dir(out, fsync=fsync) as tmp:
        folder = tmp / plan.out_tag
        jobs = []
        for rel, tree in universal_trees(plan, cache):
            (folder / rel).parent.mkdir(parents=True, exist_ok=True)
            jobs.append((folder / rel, tree))
        for f in _write_jobs(jobs, default_workers() if workers is None else workers, writeback=fsync):
            written.append(f)
            if on_file is not None:
                on_file(f)
        (tmp / "latest_universal").write_text(plan.out_tag, encoding="utf-8")
        with background_fsync(tmp, enabled=fsync):  # the disk finishes the write-back while we verify
            checked = _verify_universal(plan, tmp, cache, mode)
            cache.finish_checks()
    return ReshardResult(out, plan.out_tag, tuple(out / f.relative_to(tmp) for f in written), checked, mode.value)


def _universal_nbytes(plan: UniversalPlan) -> int:
    models = sum(p.stat().st_size for p in plan.model_files)
    return plan.copied_nbytes + models + 4 * sum(1 for _ in plan.cast_files) + (64 << 10) * (
        len(plan.state_files) + len(plan.step_files) + len(plan.cast_files) + 2)


def _verify_universal(plan: UniversalPlan, tmp: Path, cache: Any, mode: Verify) -> int:
    """Re-read the universal folder written at ``tmp`` and compare it with the source; copies compared."""
    from .readers import FileCache, read_checkpoint

    if mode is Verify.NONE:
        return 0
    # a stage-0 pipeline's tied keys, given with --tied-key, as the source was read (its ZeRO-1 plan keeps them)
    tied_keys = dict(plan.zero_layout.tied_keys) if plan.zero_layout is not None else {}
    src = read_checkpoint(plan.source_root, tag=plan.tag, cache=cache, tied_keys=tied_keys)
    new_cache = FileCache()
    new = read_checkpoint(tmp, cache=new_cache)
    stage = 1 if plan.zero_layout is not None else src.zero_stage  # a stage-0 source: written from its ZeRO-1 files
    if (new.layout, new.dp_world_size, new.optimizer_step, new.global_steps) != (
            f"universal from zero{stage}", src.dp_world_size, src.optimizer_step, src.global_steps):
        raise CorruptCheckpointError(
            f"verification failed: the written folder reads as {new.layout} ({new.dp_world_size} "
            f"ranks, optimizer step {new.optimizer_step}, global step {new.global_steps}), expected "
            f"universal from zero{stage} ({src.dp_world_size}, {src.optimizer_step}, "
            f"{src.global_steps}); nothing was written. This is a dsckpt bug: please report it")
    if src.pipeline is not None:  # ds_to_universal keeps a pipeline run's trainable params only (no layer files)
        import dataclasses

        src = dataclasses.replace(src, entries=tuple(e for e in src.entries if e.kind is Kind.PARAM and e.trainable
                                                     and e.tied_to is None))
    # ds_to_universal cuts vocabulary padding rows: no padding values to compare
    checked = compare_checkpoints(src, cache, new, new_cache, full=mode is Verify.FULL, padding=False)
    new_cache.finish_checks()
    return checked


def run_universal_distributed(plan: UniversalPlan, out: str | os.PathLike[str], group: Any, *, cache: Any = None,
                              force: bool = False, verify: Verify | str | bool = Verify.QUICK,
                              on_file: Callable[[Path], None] | None = None, workers: int | None = None,
                              fsync: bool = True) -> ReshardResult:
    """:func:`run_universal` spread over the ranks of ``group``, as :func:`run_reshard_distributed` does:
    the universal folder's files are split over the ranks by bytes; rank 0 makes the folders, checks the
    reported sizes, writes ``latest_universal``, verifies (alone, for now) and renames OUT into place."""
    from .ds_writers.universal import universal_trees

    mode, out, cache = _prepare(plan.source_root, out, verify, cache)
    group.agree({"plan": plan.describe(), "out": str(out), "verify": mode.value}, "the universal plan")
    trees = list(universal_trees(plan, cache))

    def finish(tmp: Path) -> int:
        (tmp / "latest_universal").write_text(plan.out_tag, encoding="utf-8")
        return _verify_universal(plan, tmp, cache, mode)

    rels, checked = _run_distributed(
        group, out, cache, force=force, fsync=fsync, workers=workers, on_file=on_file,
        nbytes=lambda: _universal_nbytes(plan), folders=[(Path(plan.out_tag) / rel).parent for rel, _ in trees],
        jobs=lambda tmp: [(tmp / plan.out_tag / rel, tree) for rel, tree in trees], finish=finish)
    return ReshardResult(out, plan.out_tag, tuple(out / r for r in rels), checked, mode.value)
