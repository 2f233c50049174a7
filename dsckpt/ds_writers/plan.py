"""The records every DeepSpeed layout writer plans with, and the pure range arithmetic they share.

A :class:`LayoutPlan` is the whole output: per target rank, which file, and for every flat tensor
in it (fp32 master partition, optimizer states, stage-3 frozen fragments) which element ranges of which
source tensors land where (:class:`RangeCopy`); zeros everywhere else. No tensor data, no I/O.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..hf import HfFilesPlan
from ..model import ZERO_FILL, Fragment, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from ..parallel_layout import ParallelTarget
from ..partition import DEFAULT_SUB_GROUP_SIZE

__all__ = [
    "FlatSpec",
    "GroupPartition",
    "LayoutPlan",
    "OptimizerCopies",
    "PlanWording",
    "RangeCopy",
    "SCALARS_FROM",
    "RankPlan",
    "SourceFacts",
    "Target",
    "UniversalTarget",
    "coalesce",
    "element_nbytes",
    "model_file_name",
    "optim_file_name",
    "range_copies",
    "rank_of",
    "source_layout_stage",
    "source_model_files",
    "source_optim_files",
]

ZERO_WRAPPER = "DeepSpeedZeroOptimizer"
ZERO3_WRAPPER = "DeepSpeedZeroOptimizer_Stage3"
BF16_WRAPPER = "BF16_Optimizer"


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
    partition_numel: int  # padded partition length: the optimizer states' length
    padding_numel: int  # the ``group_paddings`` entry written for this rank (stage 1/2)
    master: FlatSpec  # fp32 master as stored (ZeRO-1/2 strips the padding)
    # (state key, values) of each per-element optimizer state ("exp_avg", "momentum_buffer", ...), in the
    # optimizer's order
    states: tuple[tuple[str, FlatSpec], ...] = ()
    slice_mappings: tuple[tuple[str, int, int], ...] = ()  # (name, start, numel), stage 1/2
    ds_id: str | None = None  # stage 3: "<first ds_id>_<last ds_id>" of the sub-group
    partition_count: int | None = None  # MoE expert group: the expert-data-parallel size (else the world size)
    swapped: bool = False  # stage 3, NVMe optimizer offload: in offloaded_tensors/ swap files (dsckpt.nvme_swap)

    @property
    def state_specs(self) -> dict[str, FlatSpec]:
        return dict(self.states)


@dataclass(frozen=True)
class RankPlan:
    rank: int
    optim_file: str | None
    model_file: str | None  # stage 3: this rank's model-states file
    groups: tuple[GroupPartition, ...]
    frozen_fragments: tuple[tuple[str, FlatSpec], ...] = ()  # stage 3


@dataclass(frozen=True)
class SourceFacts:
    """Layout facts a plan needs beyond the logical model (see :func:`dsckpt.reshard.read_source_facts`).

    ``group_flat_order``: per source group (stage 1/2) or sub-group (stage 3), the trainable param
    names in flat-buffer order (``param_shapes``). ``subgroup_to_group``: the optimizer param group
    of each stage-3 sub-group. ``param_ds_ids``: each param's stage-3 ``ds_id`` (its position among
    the module's own params).
    """

    group_flat_order: tuple[tuple[str, ...], ...]
    subgroup_to_group: tuple[int, ...]
    round_robin: bool = False
    parameter_alignment: bool = False
    sub_group_size: int | None = DEFAULT_SUB_GROUP_SIZE
    param_ds_ids: tuple[tuple[str, int], ...] = ()
    autotp_meta: Any = None  # a dsckpt.autotp_widths.AutoTpMeta (the model's config.json), for a TP size change
    # Megatron's make_vocab_size_divisible_by as the checkpoint's client state records it (its ``args``), or None
    vocab_divisor: int | None = None


@dataclass(frozen=True)
class PlanWording:
    """What :mod:`dsckpt.reshard` says about a target and how it sizes it, decided with the target (phase 2,
    :attr:`.target._Decided.wording`) so that describing a plan asks no stage: ``group_label`` a rank's optimizer
    partitions (``"sub-group"`` at ZeRO-3); ``config_sub_group_size`` / ``config_zero_flags`` whether the resume
    config names ``sub_group_size`` (ZeRO-3) or the ZeRO-1/2 flags (round robin, alignment, elastic);
    ``resume_notes`` what else it must hold (``gradient_clipping`` across ZeRO-3, a stage-0 pipeline's
    ``model_parameters``); ``model_states_line`` the verb and remark of the stage-0 model-states line (None: not
    stage 0); ``model_files_per_rank`` / ``module_rebuilt`` / ``optimizer_into_model_states`` how the output's size
    is bounded (one model-states file per rank at ZeRO-3; the module rebuilt in full from a ZeRO-3 source; the
    optimizer state moved into a stage-0 target's model states)."""

    group_label: str = "group"
    config_sub_group_size: bool = False
    config_zero_flags: bool = False
    resume_notes: tuple[str, ...] = ()
    model_states_line: tuple[str, str] | None = None
    model_files_per_rank: bool = False
    module_rebuilt: bool = False
    optimizer_into_model_states: bool = False


@dataclass(frozen=True)
class Target:
    """What to write, every value decided (phase 2, :func:`.target.resolve_target`; ``docs/design.md``).

    ZeRO ``zero_stage`` (0-3) written for ``optimizer_wrapper`` on ``world_size`` data-parallel ranks (of each
    model-parallel rank); ``parallel`` every dimension's cut (data-parallel size, TP cut, pipeline stages, expert cut);
    ``sub_group_size`` ZeRO-3's (the source's at stage 3, else DeepSpeed's default, unless given);
    ``round_robin`` / ``parameter_alignment`` the target's ``zero_optimization`` flags; ``stage0_rebuilt``: a stage-0
    target rebuilt from the logical checkpoint (:func:`.stage0.plan_stage0_from_zero`), not the source's stage-0
    files rewritten; ``moe_recut``: native MoE written at another expert-parallel size (the planner reads the source
    at that cut, :func:`.moe.retarget_moe`); ``autotp_meta``: the model config AutoTP's widths at another TP size
    were taken from; ``total_world_size``: every rank (TP x stages x data-parallel).
    """

    zero_stage: int
    world_size: int
    parallel: ParallelTarget
    optimizer_wrapper: str
    sub_group_size: int | None = None
    round_robin: bool = False
    parameter_alignment: bool = False
    stage0_rebuilt: bool = False
    moe_recut: bool = False
    autotp_meta: Any = None
    total_world_size: int = 0
    # where the written optimizer files' scalars come from (one of SCALARS_FROM; LayoutPlan.scalars_from)
    scalars_from: str = "optimizer file"
    wording: PlanWording = PlanWording()  # what reshard.py says about the target (LayoutPlan.wording)
    # a pipeline target: the layer files copied unchanged (with model-parallel rank 0's files), or those of source TP
    # rank 0 re-cut for every target TP rank (another TP size: ds_writers.layer_file_trees)
    copied_layer_files: tuple[Path, ...] = ()
    recut_layer_files: tuple[Path, ...] = ()
    model_parallel_notes: tuple[str, ...] = ()  # what the TP and stage cuts do, for a model-parallel plan's notes
    precision: Any = None  # the target's precision (.precision.PrecisionTarget; None in hand-made targets: kept)


#: Where a plan's optimizer scalars (loss scaler, ``clip_grad``, param groups, step;
#: :class:`.common.OptimizerScalars`) come from, decided in phase 2 (:attr:`.target._Decided.scalars_from`): a
#: stage-0 source's model states (:func:`.common.stage0_scalars`), a universal folder's ``zero/optimizer_state.pt``
#: (:func:`.common.universal_scalars`), source rank 0's optimizer file rebuilt for the target's layout
#: (:func:`.common.optimizer_scalars`), or that file kept as it is (the same layout family and wrapper: the trees
#: keep its scalars).
SCALARS_FROM = ("stage-0 model states", "universal", "optimizer file", "optimizer file, kept")


class ModuleSource(Enum):
    """Where a written file's 16-bit module copy (``module``) comes from, decided once from the source's layout
    (:func:`module_source_of`) and handed to the writers, which do not ask what kind of source they have."""

    FULL_MODULE = "full module"  # a stage-0 source: the whole module is in its model-states file already
    FLAT_16BIT = "flat 16-bit"  # a ZeRO-1/2 source (or BF16_Optimizer's): the module's 16-bit copy in its files
    MASTERS_CAST = "masters cast"  # a ZeRO-3 source: no 16-bit copy; the module is the fp32 masters cast


def module_source_of(source_stage: int) -> ModuleSource:
    """The :class:`ModuleSource` of a source whose files have the layout of ZeRO stage ``source_stage``
    (:func:`source_layout_stage`)."""
    if source_stage == 0:
        return ModuleSource.FULL_MODULE
    return ModuleSource.MASTERS_CAST if source_stage == 3 else ModuleSource.FLAT_16BIT


@dataclass(frozen=True)
class LayoutPlan:
    """Every file of the output save dir and every byte range in it (see the package docstring)."""

    source_root: Path
    source_tag_dir: Path
    tag: str
    layout: str
    zero_stage: int  # the target's
    optimizer_wrapper: str  # the target's
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
    # the target's parallel dimensions: data-parallel size, TP cut, pipeline stages, expert cut (the same record in
    # every part of a plan)
    parallel: ParallelTarget
    notes: tuple[str, ...] = field(default_factory=tuple)
    hf_files: HfFilesPlan | None = None  # the Trainer's files carried into OUT (see dsckpt.hf)
    source_zero_stage: int | None = None  # None: same as zero_stage
    # where the written module copy comes from (decided by the planner from the source's layout; module_source_of)
    module_source: ModuleSource | None = None
    # the source (this part's view) is one stage of a pipeline: a stage-0 target names its trainable params only
    # (stage0.PIPELINE_NOTE); decided by the planner from the view's layout
    pipeline_stage: bool = False
    source_optimizer_wrapper: str | None = None  # None: same as optimizer_wrapper
    sub_group_size: int | None = None  # stage-3 target: the sub_group_size the sub-groups were formed with
    copied_model_files: tuple[Path, ...] = ()  # MoE expert (and stage-0 expp_rank_*) files, rewritten unchanged
    mp_rank: int = 0  # the model-parallel rank whose files ``ranks`` are: ``..._mp_rank_{mp_rank:02d}_...``
    source_tp_size: int = 1
    source_pp_size: int = 1
    # a target with TP or pipeline stages (parallel.model_parallel): one plan per model-parallel rank
    # m = stage * tp_size + TP rank (each an ordinary data-parallel plan of that rank's params and local slices, see
    # dsckpt.ds_writers.retarget.rank_view); this plan's own ``ranks`` are then empty.
    mp_ranks: tuple[LayoutPlan, ...] = ()
    # tensor x pipeline at another TP size: TP rank 0's layer_XX-model_00 files, each re-cut for every target TP rank
    # (the module's slices of its layer's params; dsckpt.ds_writers.layer_file_trees)
    recut_layer_files: tuple[Path, ...] = ()
    # where the optimizer scalars of the written files come from (SCALARS_FROM; Target.scalars_from)
    scalars_from: str = "optimizer file"
    wording: PlanWording = PlanWording()  # what reshard.py says about the target and how it sizes it (Target.wording)
    # DeepSpeed's own fp32 stage-0 pipeline save: the TiedLayerSpec keys the source is read with (layer, key)
    # (dsckpt.readers.read_checkpoint's tied_keys; PipelineRecord.tied_keys)
    tied_keys: tuple[tuple[int, str], ...] = ()
    # a stage-0 target rebuilt from the logical checkpoint (Target.stage0_rebuilt; stage0.plan_stage0_from_zero)
    stage0_rebuilt: bool = False
    # another precision than the source's (``--dtype``; .precision.PrecisionTarget): what phase 3 writes for it
    # (.precision.retype_tree); None when kept (``precision`` above is the source's)
    precision_change: Any = None

    def parts(self) -> tuple[LayoutPlan, ...]:
        """The data-parallel plans to write: one per model-parallel rank (stage x TP rank), or this plan itself."""
        return self.mp_ranks or (self,)

    @property
    def tp_size(self) -> int:
        return self.parallel.tp_size

    @property
    def pp_size(self) -> int:
        return self.parallel.pp_size

    @property
    def total_world_size(self) -> int:
        return self.world_size * self.tp_size * self.pp_size

    @property
    def source_total_world_size(self) -> int:
        return self.source_world_size * self.source_tp_size * self.source_pp_size

    @property
    def from_stage(self) -> int:
        return self.zero_stage if self.source_zero_stage is None else self.source_zero_stage

    @property
    def from_wrapper(self) -> str:
        return self.optimizer_wrapper if self.source_optimizer_wrapper is None else self.source_optimizer_wrapper

    @property
    def changes_layout(self) -> bool:
        """True when the target is another ZeRO stage or optimizer wrapper than the source."""
        return self.from_stage != self.zero_stage or self.from_wrapper != self.optimizer_wrapper

    @property
    def written_precision(self) -> Precision:
        """The precision of the written files (the target's)."""
        return self.precision if self.precision_change is None else self.precision_change.precision

    @property
    def has_work(self) -> bool:
        return (self.precision_change is not None or self.world_size != self.source_world_size
                or self.changes_layout or self.tp_size != self.source_tp_size
                or self.pp_size != self.source_pp_size
                or (self.parallel.stages is not None and self.parallel.stages.target is not None))

    @property
    def copied_nbytes(self) -> int:
        if self.mp_ranks:
            return sum(p.copied_nbytes for p in self.mp_ranks)
        total = 0
        for r in self.ranks:
            for g in r.groups:
                total += 4 * (g.master.numel + sum(spec.numel for _, spec in g.states))
            for _, spec in r.frozen_fragments:
                total += 2 * spec.numel
        return total


class OptimizerCopies:
    """The range copies of one target partition's optimizer-side flat tensors: the fp32 master and each
    per-element optimizer state of the group's params (their keys, in the optimizer's order: every param of the
    group must have every one). ``whole``: state keys kept whole per param rather than partitioned (Muon's ZeRO-1/2
    ``momentum_buffer``: each param that meets the partition, whole, one after the other)."""

    def __init__(self, ckpt: LogicalCheckpoint, entries: Iterable[TensorEntry], whole: Sequence[str] = ()) -> None:
        self.tag_dir = ckpt.tag_dir
        self.keys = tuple(dict.fromkeys(k for e in entries for k in e.state_keys))
        self.whole = {k: 0 for k in whole if k in self.keys}  # key -> its length so far
        self.dtypes: dict[str, str] = {}
        self.master: list[RangeCopy] = []
        self.states: dict[str, list[RangeCopy]] = {k: [] for k in self.keys}

    def add(self, name: str, entry: TensorEntry, elem_start: int, numel: int, dst_offset: int) -> None:
        """Elements ``[elem_start, elem_start + numel)`` of param ``name`` land at ``dst_offset`` (the whole param
        at the end of each ``whole`` state)."""
        for key, lst in ((None, self.master), *self.states.items()):
            piece = entry.piece(Role.MASTER) if key is None else entry.state_piece(key)
            if piece is None:
                raise CorruptCheckpointError(f"'{self.tag_dir}': param '{name}' has no {key or 'master'} values")
            if key is not None:
                self.dtypes.setdefault(key, piece.dtype)
            if key is not None and key in self.whole:
                lst.extend(range_copies(piece, 0, entry.numel, self.whole[key], name))
                self.whole[key] += entry.numel
            else:
                lst.extend(range_copies(piece, elem_start, numel, dst_offset, name))

    def master_spec(self, numel: int) -> FlatSpec:
        return FlatSpec(numel, "float32", coalesce(self.master))

    def state_specs(self, numel: int) -> tuple[tuple[str, FlatSpec], ...]:
        return tuple((k, FlatSpec(self.whole.get(k, numel), self.dtypes.get(k, "float32"), coalesce(c)))
                     for k, c in self.states.items())


def element_nbytes(precision: Precision) -> int:
    return 4 if precision is Precision.FP32 else 2


def range_copies(piece: Piece | None, elem_start: int, numel: int, dst_offset: int,
                 name: str) -> tuple[RangeCopy, ...]:
    """Where elements ``[elem_start, elem_start + numel)`` of a logical tensor are stored: one copy per contiguous
    stretch, in destination order where the piece has strided fragments (tensor-parallel row slices: one copy per
    row run the range meets, found by arithmetic, not by expanding the fragment's every run). Elements of
    :data:`~dsckpt.model.ZERO_FILL` fragments get no copy: a :class:`FlatSpec` is zero where nothing writes."""
    if piece is None or numel <= 0:
        return ()
    out: list[RangeCopy] = []
    end = elem_start + numel
    zeros = 0  # elements of ZERO_FILL fragments: left as the FlatSpec's zeros
    for f in piece.fragments:
        for s, e, src in _runs_within(f, elem_start, end):
            lo, hi = max(elem_start, s), min(end, e)
            if lo < hi and f.file == ZERO_FILL:
                zeros += hi - lo
            elif lo < hi:
                out.append(RangeCopy(f.file, f.key, src + (lo - s), hi - lo, dst_offset + (lo - elem_start)))
    covered = zeros + sum(c.numel for c in out)
    if covered != numel:
        raise CorruptCheckpointError(
            f"tensor '{name}': its {piece.label} copy covers {covered} of elements "
            f"[{elem_start}, {end}); the checkpoint's fragments are incomplete")
    if any(f.strided for f in piece.fragments):
        out.sort(key=lambda c: c.dst_offset)
    return tuple(out)


def _runs_within(f: Fragment, lo: int, hi: int) -> list[tuple[int, int, int]]:
    """``(dst start, dst end, src start)`` of the runs of ``f`` that overlap ``[lo, hi)`` (a contiguous ``f``: itself,
    whether it overlaps or not)."""
    if not f.strided:
        return [(f.dst_offset, f.dst_offset + f.numel, f.src_offset)]
    r = f.run_numel
    k0, k1 = f.window(lo, hi)
    return [(f.dst_index(i * r), f.dst_index(i * r) + r, f.src_index(i * r)) for i in range(k0 // r, -(-k1 // r))]


def coalesce(copies: Sequence[RangeCopy]) -> tuple[RangeCopy, ...]:
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


def rank_of(path: Path) -> int:
    m = re.search(r"zero_pp_rank_(\d+)_", path.name)
    return int(m[1]) if m else -1


def optim_file_name(rank: int, bf16_prefix: bool, mp_rank: int = 0) -> str:
    return f"{'bf16_' if bf16_prefix else ''}zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_optim_states.pt"


def model_file_name(rank: int, mp_rank: int = 0) -> str:
    """A stage-3 rank's model-states file (DeepSpeed never prefixes it with ``bf16_``)."""
    return f"zero_pp_rank_{rank}_mp_rank_{mp_rank:02d}_model_states.pt"


def source_layout_stage(ckpt: LogicalCheckpoint) -> int:
    """The ZeRO stage whose file layout ``ckpt`` uses. DeepSpeed 0.10.3 to 0.16.9 (written by 0.14.5 and
    0.16.9) wrap stage-0 bf16 in BF16_Optimizer -- their bf16 grad_accum_dtype defaults to fp32 without ZeRO --
    so the fp32 masters are partitioned in ``bf16_zero_pp_rank_*`` files like ZeRO-1, while the ds_config
    (kept as written) says stage 0. 0.18.9 and 0.19.8 default grad_accum_dtype to bf16 and use
    FP16_UnfusedOptimizer there."""
    if ckpt.zero_stage == 0 and ckpt.optimizer_wrapper == BF16_WRAPPER:
        return 1
    return ckpt.zero_stage


def source_model_files(ckpt: LogicalCheckpoint) -> tuple[Path, ...]:
    """The source's model-states files a writer reads: one per rank at stage 3 (rank order), else
    ``mp_rank_XX_model_states.pt`` (of a TP rank's view, :func:`dsckpt.tensor_parallel.rank_view`, that rank's)."""
    if source_layout_stage(ckpt) == 3:
        return tuple(sorted((p for p in ckpt.files if p.name.startswith("zero_pp_rank_")
                             and p.name.endswith("_model_states.pt")), key=rank_of))
    return tuple(p for p in ckpt.files if re.fullmatch(r"mp_rank_\d+_model_states\.pt", p.name))


def source_optim_files(ckpt: LogicalCheckpoint) -> tuple[Path, ...]:
    """The source's per-rank optimizer files, in rank order."""
    return tuple(sorted((p for p in ckpt.files if "optim_states" in p.name), key=rank_of))


@dataclass(frozen=True)
class UniversalTarget:
    """What a universal folder of the source is written as (:func:`.target.resolve_universal`; the folder is planned by
    :func:`.universal.plan_universal`). ``source_stage``: the ZeRO stage whose layout the source's files use
    (``zero3``: the ZeRO-3 form of the folder); ``from_zero1``: a stage-0 source (or a bf16 pipeline's
    ``BF16_Optimizer`` files without ``param_shapes``), written as the folder of the ZeRO-1 files of the same run
    planned at its own size (``zero1_world_size`` ranks); ``pipeline``: a pipeline run, whose model states hold no
    module (no ``zero/<name>/fp32.pt`` of buffers and frozen params); ``autoep`` / ``expert_cuts``: AutoEP's stacked
    expert params and their cuts (ds_to_universal's expert keys)."""

    source_stage: int
    from_zero1: bool
    zero1_world_size: int
    pipeline: bool
    autoep: bool
    expert_cuts: Any  # Mapping[str, ParamCut]: AutoEP's stacked expert params ({} without AutoEP)

    @property
    def zero3(self) -> bool:
        return self.source_stage == 3
