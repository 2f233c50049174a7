"""Phase 2 of a reshard plan: resolve the target, once (``docs/design.md``).

:func:`resolve_target` checks every flag of a :class:`ReshardRequest` against the source's
:class:`~.source.SourceDescription` in one table, :data:`RULES`, read top to bottom: each row names the flag (or
dimension) it is about, when it refuses and what it says. What the rows need is decided lazily, each value once, by
:class:`_Decided` (the ZeRO stage, the TP size and cut, the pipeline stages, the expert cut, ...); the first row that
refuses raises its error. What passes becomes a frozen :class:`~.plan.Target`: ZeRO stage, optimizer wrapper,
data-parallel size, the :class:`~dsckpt.parallel_layout.ParallelTarget` (TP cut, stages, expert cut), ZeRO-3
sub-group size, round robin and alignment, which stage-0 writer, the precision (:mod:`.precision`) -- what the
planner (phase 3) composes without asking
what kind of source or target it has.

A new target dimension (``--dtype``, next) is a field of :class:`ReshardRequest`, its decision in :class:`_Decided`,
its rows here and its module; no writer changes to ask it.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path
from typing import Any, cast

from ..errors import DsckptError, UnsupportedCheckpointError, UsageError
from ..model import Kind, Precision
from ..parallel_layout import AutoEpLayout, MoeLayout, ParallelTarget, StagePlan, TpLayout
from ..partition import DEFAULT_SUB_GROUP_SIZE
from .facts import elastic_target_refusal
from .plan import BF16_WRAPPER, ZERO3_WRAPPER, ZERO_WRAPPER, PlanWording, Target, UniversalTarget
from .precision import PrecisionTarget, decide_precision, loss_scale_refusal, precision_refusal
from .source import SourceDescription

__all__ = ["RULES", "UNIVERSAL_RULES", "ReshardRequest", "Rule", "UniversalTarget", "refuse_universal",
           "resolve_target", "resolve_universal"]


@dataclass(frozen=True)
class ReshardRequest:
    """The flags of ``dsckpt reshard`` (or :func:`dsckpt.reshard.plan_reshard`'s arguments), as given: None where
    the source's value is kept. ``world_size`` counts every rank (TP x stages x data-parallel)."""

    world_size: int
    zero_stage: int | None = None
    sub_group_size: int | None = None
    tp_size: int | None = None
    ep_size: int | None = None
    pp_size: int | None = None
    partition_method: str | None = None
    num_layers: int | None = None
    layer_types: Sequence[str] | None = None
    vocab_divisor: int | None = None  # --make-vocab-size-divisible-by
    bf16_optimizer: bool | None = None  # write BF16_Optimizer files (None: the source's wrapper where allowed)
    round_robin: bool | None = None  # the target's zero_optimization flags (None: the source's)
    parameter_alignment: bool | None = None
    dtype: str | None = None  # --dtype fp32|fp16|bf16 (None: the source's precision)
    loss_scale: float | None = None  # --loss-scale: an fp16 target's initial dynamic scale


class _Decided:
    """The target's values, each decided once, when a rule (or :func:`resolve_target`) first asks."""

    def __init__(self, src: SourceDescription, req: ReshardRequest) -> None:
        self.src, self.req = src, req

    @cached_property
    def tp(self) -> Any:  # not checked yet: a rule refuses what is no positive integer
        return self.src.tp_size if self.req.tp_size is None else self.req.tp_size

    @cached_property
    def stages(self) -> StagePlan | None:
        """The target's pipeline stages (:func:`dsckpt.pipeline_stages.plan_stages`, which refuses what the partition
        method cannot give), None without a pipeline."""
        if not self.src.pipeline:
            return None
        from ..pipeline_stages import plan_stages

        r = self.req
        return plan_stages(self.src.ckpt, r.pp_size, method=r.partition_method, num_layers=r.num_layers,
                           layer_types=r.layer_types)

    @cached_property
    def pp(self) -> int:
        return self.stages.pp_size if self.stages is not None else 1

    @cached_property
    def dp(self) -> int:
        return self.req.world_size // (self.tp * self.pp)

    @cached_property
    def stage(self) -> int:
        return self.src.stage if self.req.zero_stage is None else self.req.zero_stage

    @cached_property
    def precision(self) -> PrecisionTarget:
        """The target's precision and what it decides (:mod:`.precision`)."""
        return decide_precision(self.src, self.req.dtype if self.req.dtype in ("fp32", "fp16", "bf16") else None,
                                self.req.loss_scale)

    @cached_property
    def autotp_meta(self) -> Any:
        """AutoTP's widths at another TP size depend on the model's key/value heads: its ``config.json``, beside the
        tag (:func:`dsckpt.autotp_widths.read_autotp_meta`), unless the facts carry them."""
        facts = self.src.facts
        if self.tp not in (1, self.src.tp_size) and self.src.tensor_parallel and facts.autotp_meta is None:
            from ..autotp_widths import read_autotp_meta

            return read_autotp_meta(self.src.ckpt.root, self.src.ckpt.ds_config)
        return facts.autotp_meta

    @cached_property
    def experts(self) -> AutoEpLayout | MoeLayout | None:
        """The expert cut written anew: AutoEP's at the target's expert-parallel size (:func:`.autoep.autoep_target`,
        always), native MoE's at another ``--ep-size`` (:func:`.moe.moe_layout_at`); None otherwise."""
        ckpt, ep = self.src.ckpt, self.req.ep_size
        if self.moe_recut:
            from .moe import moe_layout_at

            assert ckpt.moe is not None and ep is not None
            return moe_layout_at(ckpt.moe, ep)
        if self.src.autoep:
            from .autoep import autoep_target

            return autoep_target(ckpt, self.dp, ep)
        return None

    @cached_property
    def moe_recut(self) -> bool:
        """Native MoE written at another expert-parallel size."""
        moe = self.src.ckpt.moe
        return self.req.ep_size is not None and moe is not None and set(moe.ep_sizes) != {self.req.ep_size}

    @cached_property
    def tp_layout(self) -> TpLayout | None:
        """The target's TP cut: the source's cuts at the target's TP size (:func:`dsckpt.tensor_parallel.resize_layout`,
        whose refusals name the checkpoint); None without tensor parallelism."""
        if not self.src.tensor_parallel and self.tp == 1:
            return None
        from ..tensor_parallel import resize_layout

        assert self.src.ckpt.tensor_parallel is not None
        try:
            divisor = self.req.vocab_divisor if self.req.vocab_divisor is not None else self.src.facts.vocab_divisor
            return resize_layout(self.src.ckpt.tensor_parallel, self.tp, meta=self.autotp_meta, vocab_divisor=divisor)
        except UnsupportedCheckpointError as e:
            raise UnsupportedCheckpointError(f"cannot reshard '{self.src.tag_dir}': {e}") from e

    @cached_property
    def parallel(self) -> ParallelTarget:
        return ParallelTarget(self.dp, self.tp_layout, self.stages, self.experts)

    @cached_property
    def recut_layer_files(self) -> tuple[Path, ...]:
        """A pipeline at another TP size: source TP rank 0's layer files, each re-cut for every target TP rank."""
        if self.stages is None or self.parallel.tp_size == self.src.tp_size:
            return ()
        assert self.src.ckpt.pipeline is not None
        return self.src.ckpt.pipeline.tp_rank(0).layer_files

    @cached_property
    def copied_layer_files(self) -> tuple[Path, ...]:
        """A pipeline at its TP size: the layer files, copied unchanged."""
        if self.stages is None or self.recut_layer_files:
            return ()
        assert self.src.ckpt.pipeline is not None
        return self.src.ckpt.pipeline.layer_files

    @cached_property
    def model_parallel_notes(self) -> tuple[str, ...]:
        """What the TP cut and the stages do, for a model-parallel plan's notes (after its ranks' own)."""
        src, layout, stages, tp = self.src, self.parallel.tp, self.stages, self.parallel.tp_size
        notes: list[str] = []
        if layout is not None and tp != src.tp_size and layout.source == "megatron":
            from ..tensor_parallel import megatron_note

            notes.append(megatron_note(src.ckpt.tensor_parallel, layout))
        elif layout is not None and tp not in (1, src.tp_size):
            from ..autotp_widths import autotp_note

            notes.append(autotp_note(layout, src.tp_size, self.autotp_meta))
        if stages is not None:
            notes.append(stages.note(layer_files_recut=bool(self.recut_layer_files)))
        if (stages is not None and src.ckpt.zero_stage == 0 and src.wrapper == BF16_WRAPPER
                and not self.precision.changed):  # --dtype: DeepSpeedZeroOptimizer files, said by the precision row
            from .stage0 import STAGE0_BF16_PIPELINE_NOTE

            notes.append(STAGE0_BF16_PIPELINE_NOTE)
        if self.recut_layer_files:
            ckpt = src.ckpt
            frozen = sum(1 for e in ckpt.entries if e.kind is Kind.PARAM and not e.trainable and e.tied_to is None)
            notes.append(f"layer files re-cut for TP {tp}: {len(self.recut_layer_files)} per TP rank, from the "
                         "module's 16-bit slices" + (f" (frozen params' too: {frozen}, whose only copy they are)"
                                                     if frozen else ""))
        return tuple(notes)

    @cached_property
    def stage0_rebuilt(self) -> bool:
        """Whether a stage-0 target is rebuilt from the logical checkpoint (:func:`.stage0.plan_stage0_from_zero`)
        rather than the source's stage-0 files rewritten (:func:`.stage0.plan_stage0`): a ZeRO source; a pipeline
        (each stage's optimizer order is the stage plan's); native MoE at another expert-parallel size (one
        ``expp_rank_*`` file per new rank); another TP size (each TP rank's module and optimizer state re-cut)."""
        return (self.src.stage != 0 or self.src.ckpt.layout == "pipeline" or self.parallel.tp_size != self.src.tp_size
                or isinstance(self.parallel.experts, MoeLayout))

    @cached_property
    def writes_optimizer_layout(self) -> bool:
        """Whether the target's ZeRO layout is planned from the source's optimizer state (not a stage-0 rewrite)."""
        return not (self.stage == 0 and self.stage0_rebuilt)

    @cached_property
    def wording(self) -> PlanWording:
        """What :mod:`dsckpt.reshard` says about this target and how it bounds its size
        (:class:`~.plan.PlanWording`)."""
        src, stage = self.src.stage, self.stage
        notes = []
        if src == 3 and stage != 3:
            notes.append("gradient_clipping as you want it (ZeRO-3 files store no clip_grad)")
        elif src != 3 and stage == 3:
            notes.append("gradient_clipping as you want it (ZeRO-3 files store no clip_grad; the input's "
                         "optimizer files recorded one)")
        if stage == 0 and self.stages is not None:  # ds_writers.stage0.PIPELINE_NOTE
            notes.append("model_parameters=[p for p in model.parameters() if p.requires_grad] (each stage's optimizer "
                         "numbers its params that require grad)")
        line = None
        if stage == 0:  # stages: each file rebuilt from its stage's params; else one per model-parallel (TP) rank
            line = ("write", " (each stage's optimizer state)") if self.stages is not None else ("rewrite", "")
        return PlanWording(
            group_label="sub-group" if stage == 3 else "group", config_sub_group_size=stage == 3,
            config_zero_flags=stage in (1, 2), resume_notes=tuple(notes), model_states_line=line,
            model_files_per_rank=stage == 3, module_rebuilt=src == 3 and stage != 3,
            optimizer_into_model_states=stage == 0 and src != 0)

    @cached_property
    def scalars_from(self) -> str:
        """Where the written optimizer files' scalars come from (:data:`~.plan.SCALARS_FROM`): a stage-0 source's model
        states; a universal folder's ``zero/optimizer_state.pt`` (a stage-0 target too); for a stage-0 target rebuilt
        from ZeRO files, source rank 0's optimizer file; else that file, kept as it is where the target is of the same
        layout family (ZeRO-3 or not) and wrapper."""
        if self.src.stage == 0:
            return "stage-0 model states"
        if self.src.universal:
            return "universal"
        if self.stage == 0 and self.stage0_rebuilt:
            return "optimizer file"
        same_family = (self.src.stage == 3) == (self.stage == 3) and self.src.wrapper == self.wrapper
        return "optimizer file, kept" if same_family else "optimizer file"

    @cached_property
    def wrapper(self) -> str:
        """The optimizer wrapper the target files are written for."""
        if self.stage == 0:
            return self.src.wrapper
        if self.stage == 3:
            return ZERO3_WRAPPER
        wants_bf16 = (self.req.bf16_optimizer if self.req.bf16_optimizer is not None
                      else self.src.wrapper == BF16_WRAPPER and self.stage == 1 and not self.precision.changed)
        return BF16_WRAPPER if wants_bf16 else ZERO_WRAPPER


def _bad_int(value: Any) -> bool:
    return not isinstance(value, int) or value < 1


@dataclass(frozen=True)
class Rule:
    """One row of :data:`RULES`: ``refuses(source, request, decided)`` is the message when the row refuses (None when
    it lets the request pass); ``error`` the exception it raises."""

    flag: str
    refuses: Callable[[SourceDescription, ReshardRequest, _Decided], str | None]
    error: type[DsckptError] = UnsupportedCheckpointError


def _pipeline_stage(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if s.pipeline and r.zero_stage not in (None, 0, 1):
        return (f"cannot reshard '{s.tag_dir}' (a pipeline run) to ZeRO stage {r.zero_stage}: DeepSpeed's "
                "PipelineEngine refuses ZeRO-2 and ZeRO-3 (\"incompatible with pipeline parallelism\"); pick "
                "--zero-stage 1 or, at fp32, 0")
    return None


def _pipeline_stage0(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    """A pipeline target without ZeRO is written at fp32 only (a torch optimizer per stage,
    :func:`.stage0.plan_stage0_from_zero`): a 16-bit pipeline without ZeRO trains under ``BF16_Optimizer``, whose
    stage-0 save DeepSpeed 0.19.8 cannot resume (``ds_writers.STAGE0_BF16_PIPELINE_NOTE``)."""
    if s.pipeline and r.zero_stage == 0 and d.precision.precision is not Precision.FP32:
        return (f"cannot reshard '{s.tag_dir}' (a pipeline run) to ZeRO stage 0: a {d.precision.precision.value} "
                "pipeline without ZeRO trains under BF16_Optimizer, whose stage-0 save DeepSpeed 0.19.8 cannot resume "
                "even unchanged (KeyError in BF16_Optimizer._load_legacy_checkpoint); keep --zero-stage 1 (the same "
                "optimizer and state)")
    return None


def _pipeline_flags(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    d.stages  # noqa: B018 -- the stages are planned (and refused) here, before the world-size row
    if not s.pipeline and (r.pp_size not in (None, 1) or r.partition_method is not None or r.num_layers is not None
                           or r.layer_types):
        return (f"--pp-size, --partition-method, --num-layers and --layer-types are for pipeline "
                f"(PipelineModule) checkpoints, and '{s.tag_dir}' has no pipeline stages")
    return None


def _world_cut(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if r.world_size % (d.tp * d.pp):
        return (f"--world-size {r.world_size} is not a multiple of the tensor-parallel size {d.tp} times the "
                f"pipeline size {d.pp} (the data-parallel size is world size / (TP size x pipeline stages))")
    d.autotp_meta  # noqa: B018 -- read (and refused) here, before the elastic row
    return None


def _no_experts(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if r.ep_size is not None and not s.autoep and not s.moe:
        return (f"cannot reshard '{s.tag_dir}' to expert-parallel size {r.ep_size}: --ep-size is for "
                "Mixture-of-Experts checkpoints (DeepSpeed AutoEP or deepspeed.moe), and this one has no experts")
    return None


def _moe_ep(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if d.moe_recut:
        from .moe import ep_size_refusal

        assert r.ep_size is not None
        return ep_size_refusal(s.ckpt, r.ep_size, d.dp)
    return None


def _autoep_tp(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if s.autoep and not d.moe_recut:
        if d.tp != 1:
            return (f"cannot reshard '{s.tag_dir}' to tensor parallelism {d.tp}: AutoEP together with AutoTP is not "
                    "supported")
        d.experts  # noqa: B018 -- AutoEP's cut at the target's size (refuses sizes the experts do not allow)
    return None


def _tp_record(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if d.tp != 1 and not s.tensor_parallel:
        return (f"cannot reshard '{s.tag_dir}' to tensor parallelism {d.tp}: it was saved without tensor parallelism, "
                "so it has no record of how each param splits (DeepSpeed AutoTP writes universal_checkpoint_info only "
                "at TP > 1), and dsckpt does not re-derive AutoTP's layer policy (HF tp_plan, presets, name "
                f"heuristics) from the model code. Write it with --universal instead and load that with "
                f"\"checkpoint\": {{\"load_universal\": true}} and autotp_size {d.tp}: DeepSpeed's universal loader "
                "cuts each param by the live AutoTP layer")
    d.parallel  # noqa: B018 -- the TP cut (refuses what the record cannot be re-cut to)
    return None


def _moe_zero3(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if d.writes_optimizer_layout and s.moe and d.stage != s.stage and 3 in (s.stage, d.stage):
        return (f"cannot convert '{s.tag_dir}' (Mixture of Experts) from ZeRO stage {s.stage} to stage "
                f"{d.stage}: DeepSpeed 0.19.8 has no native MoE at ZeRO-3 (\"Native DeepSpeed MoE is not "
                "supported with ZeRO Stage 3\"); pick stage 0, 1 or 2")
    return None


def _muon(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if d.writes_optimizer_layout and d.stage in (0, 3) and s.muon:
        return (f"cannot convert '{s.tag_dir}' (Muon) from ZeRO stage {s.stage} to stage {d.stage}: "
                "Muon's ZeRO-1/2 momentum holds whole params, and dsckpt writes it at ZeRO-1/2 only; reshard it at "
                "stage 1 or 2")
    return None


def _bf16_optimizer(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if not d.writes_optimizer_layout or d.stage == 0:
        return None
    if d.stage == 3 and r.bf16_optimizer:
        return "BF16_Optimizer files exist for ZeRO stage 1 only (bf16_optimizer.py); drop the option"
    if d.wrapper == BF16_WRAPPER and (d.stage != 1 or d.precision.precision is not Precision.BF16):
        return "BF16_Optimizer files are written for bf16 checkpoints at ZeRO stage 1 only"
    return None


def _precision(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    if not d.precision.changed:
        return None
    return precision_refusal(s, d.precision, d.stage, d.tp, d.stages is not None, r.ep_size is not None)


def _stage0_rebuilt(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    """A stage-0 target rebuilt from the logical checkpoint: what :func:`.stage0.plan_stage0_from_zero` cannot write
    (:func:`.stage0.stage0_refusal` of every model-parallel rank's view, as the planner will see them:
    :func:`dsckpt.ds_writers.plan_layout` takes native MoE at the target's expert cut, then
    :func:`.retarget.rank_view` per model-parallel rank, then :func:`dsckpt.ds_writers.source_group_orders`; the
    first refusal, in rank order). Here, not in :mod:`.stage0`, so that the layout module needs nothing from the
    package that imports it."""
    if d.stage != 0 or not d.stage0_rebuilt:
        return None
    from . import source_group_orders
    from .moe import retarget_moe
    from .retarget import rank_view
    from .stage0 import stage0_refusal

    ckpt, facts, parallel = s.ckpt, s.facts, d.parallel
    if d.moe_recut:
        ckpt, facts = retarget_moe(ckpt, facts, cast(int, parallel.ep_size), d.dp)  # moe_recut: --ep-size given
    for m in range(parallel.mp_size) if parallel.model_parallel else (None,):
        view, view_facts = (ckpt, facts) if m is None else rank_view(ckpt, facts, parallel, m)
        view, orders = source_group_orders(view, view_facts)
        why = stage0_refusal(view, orders, d.dp)
        if why is not None:
            return why
    return None


def _moe_world(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
    """Native MoE at its own expert-parallel sizes: each must divide the data-parallel size (another ``--ep-size``:
    the ``--ep-size (native MoE)`` row)."""
    if not s.moe or d.moe_recut:
        return None
    from .moe import moe_world_refusal

    return moe_world_refusal(s.ckpt, d.dp)


def _positive(flag: str, value: Callable[[ReshardRequest, _Decided], Any], shown: Callable[[ReshardRequest], Any]
              ) -> Rule:
    def refuses(s: SourceDescription, r: ReshardRequest, d: _Decided) -> str | None:
        v = value(r, d)
        return f"{flag} must be a positive integer, got {shown(r)!r}" if v is not None and _bad_int(v) else None
    return Rule(flag, refuses, UsageError)


# --------------------------------------------------------------------------------------------
# A universal folder as the target (reshard --universal): its own decisions and rows


def resolve_universal(src: SourceDescription) -> UniversalTarget:
    """The :class:`UniversalTarget` of ``src``; refuses an ``elastic_checkpoint`` source (whose files keep no param
    groups, which the folder stores). The folder's own refusals are :data:`UNIVERSAL_RULES`
    (:func:`refuse_universal`), checked once the ZeRO-1 files of a stage-0 source are planned."""
    if src.elastic:
        raise UnsupportedCheckpointError(elastic_target_refusal(src.ckpt, zero_stage=None, universal=True) or "")
    ckpt = src.ckpt
    # without ZeRO optimizer files, or (a bf16 pipeline's BF16_Optimizer files) without param_shapes in the model
    # states; DeepSpeed 0.10-0.16's stage-0 bf16 BF16_Optimizer saves have both and convert as they are: the same
    # rank count's ZeRO-1 files are planned (the three phases of plan_reshard) and their universal folder written
    from_zero1 = (src.stage == 0 or (ckpt.zero_stage == 0 and src.pipeline)) and not src.universal
    return UniversalTarget(
        source_stage=src.stage, from_zero1=from_zero1,
        zero1_world_size=ckpt.dp_world_size * max(1, ckpt.tp_world_size) * max(1, ckpt.pp_world_size),
        pipeline=src.pipeline, autoep=src.autoep,
        expert_cuts=ckpt.autoep.name_to_cut if ckpt.autoep is not None else {})


def _universal_sub_params(s: SourceDescription) -> str | None:
    from .universal import universal_tp_keys

    tp = s.ckpt.tensor_parallel
    sub_params = [c.name for c in tp.name_to_cut.values() if universal_tp_keys(c, tp.source) is None] if tp else []
    if sub_params:
        return (f"params with sub-params ({', '.join(sub_params[:5])}) whose parameter_with_sub_params entry in the "
                "Megatron-style record is not the SubparamShape ds_to_universal writes back (exactly patterns, shape "
                "and partition_dim, the sub-param sizes listed at shape[partition_dim] and adding up to the param's "
                "rows)")
    return None


def _universal_pipeline_record(s: SourceDescription) -> str | None:
    ckpt = s.ckpt
    if (ckpt.pp_world_size > 1 or ckpt.layout == "pipeline") and not s.pipeline:
        return f"pipeline parallel size {ckpt.pp_world_size}" + (
            f" x tensor parallel size {ckpt.tp_world_size}" if ckpt.tp_world_size > 1 else "")
    return None


#: What a universal folder cannot be written from, in the order the refusal lists it (every row that applies is
#: listed, in one message: :func:`refuse_universal`). Each row: what it is about, and ``refuses(source, target)``.
UNIVERSAL_RULES: tuple[tuple[str, Callable[[SourceDescription, UniversalTarget], str | None]], ...] = (
    ("ZeRO stage 0", lambda s, t: "ZeRO stage 0 without the ZeRO-1 layout it is written from (ds_to_universal "
     "converts ZeRO optimizer files and model states naming their params; plan it with "
     "dsckpt.reshard.plan_universal_reshard)" if not t.from_zero1 and (
         s.stage not in (1, 2, 3) or (s.pipeline and s.ckpt.zero_stage == 0)) else None),
    ("native MoE", lambda s, t: "native Mixture-of-Experts layers (no universal form holds them: DeepSpeed 0.19.8's "
     "universal loader looks each param up by its engine name, and an expert's is its local one, "
     "deepspeed_experts.<i>, the same on every expert-parallel rank; reshard it as ZeRO files, --ep-size for another "
     "expert-parallel size)" if s.moe else None),
    ("pipeline record", lambda s, t: _universal_pipeline_record(s)),
    ("tensor-parallel record", lambda s, t: f"tensor parallel size {s.ckpt.tp_world_size} without a tensor-parallel "
     "record" if s.ckpt.tp_world_size > 1 and not s.tensor_parallel else None),
    ("sub-params", lambda s, t: _universal_sub_params(s)),
    ("universal source", lambda s, t: "a universal checkpoint already" if s.universal else None),
    ("Muon", lambda s, t: "Muon param groups, whose ZeRO-1/2 momentum holds whole params and which ds_to_universal "
     "does not convert" if s.muon else None),
    ("optimizer files", lambda s, t: "no ZeRO optimizer files" if not s.optim_files and not t.from_zero1 else None),
)


def refuse_universal(src: SourceDescription, target: UniversalTarget) -> None:
    """Refuse (:class:`UnsupportedCheckpointError`, every problem of :data:`UNIVERSAL_RULES` in one message) a
    source whose universal folder cannot be written."""
    problems = [m for _, refuses in UNIVERSAL_RULES if (m := refuses(src, target)) is not None]
    if problems:
        raise UnsupportedCheckpointError(
            f"cannot write a universal checkpoint of '{src.tag_dir}': found " + "; ".join(problems))


#: Every check of a reshard's flags against its source, in the order they are made (the first refusal is reported).
#: Each row: the flag or dimension, when and why it refuses, the error (exit code 2 for usage, 3 for what cannot be
#: written). The rows marked "decided" also decide a dimension of the target, whose own module refuses what it
#: cannot cut (pipeline stages, AutoEP's and native MoE's expert cuts, the TP cut).
RULES: tuple[Rule, ...] = (
    Rule("--world-size", lambda s, r, d: f"--world-size must be a positive integer, got {r.world_size!r}"
         if _bad_int(r.world_size) else None, UsageError),
    Rule("--zero-stage", lambda s, r, d: None if r.zero_stage in (None, 0, 1, 2, 3) else
         f"--zero-stage must be 0, 1, 2 or 3, got {r.zero_stage!r}", UsageError),
    _positive("--sub-group-size", lambda r, d: r.sub_group_size, lambda r: r.sub_group_size),
    _positive("--tp-size", lambda r, d: d.tp, lambda r: r.tp_size),
    Rule("--dtype / --loss-scale", lambda s, r, d: loss_scale_refusal(r.dtype, r.loss_scale, d.precision),
         UsageError),
    Rule("--zero-stage (pipeline)", _pipeline_stage),
    Rule("--zero-stage 0 (pipeline)", _pipeline_stage0),
    Rule("--pp-size ... (decided: pipeline stages)", _pipeline_flags, UsageError),
    Rule("--world-size (TP x PP; decided: AutoTP widths' config.json)", _world_cut, UsageError),
    Rule("elastic_checkpoint", lambda s, r, d: elastic_target_refusal(
        s.ckpt, zero_stage=d.stage, tp_size=d.tp, ep_size=r.ep_size) if s.elastic else None),
    Rule("--sub-group-size (ZeRO-3)", lambda s, r, d: "--sub-group-size applies to a ZeRO-3 target only; add "
         "--zero-stage 3" if r.sub_group_size is not None and d.stage != 3 else None, UsageError),
    _positive("--ep-size", lambda r, d: r.ep_size, lambda r: r.ep_size),
    _positive("--make-vocab-size-divisible-by", lambda r, d: r.vocab_divisor, lambda r: r.vocab_divisor),
    Rule("--ep-size (no experts)", _no_experts),
    Rule("--ep-size (native MoE; decided: expert cut)", _moe_ep),
    Rule("--tp-size (AutoEP; decided: expert cut)", _autoep_tp),
    Rule("--tp-size (decided: TP cut)", _tp_record),
    Rule("--zero-stage (native MoE)", _moe_zero3),
    Rule("--zero-stage (Muon)", _muon),
    Rule("BF16_Optimizer", _bf16_optimizer, UsageError),
    Rule("--dtype (decided: precision; the layouts a precision change is written for)", _precision),
    # what the layout's own module refuses once every flag passed (each asked here, before any file is planned)
    Rule("--zero-stage 0 (rebuilt: param groups, AutoEP, native MoE, the 16-bit wrapper)", _stage0_rebuilt),
    Rule("--world-size (native MoE's expert-parallel sizes)", _moe_world),
)


def resolve_target(src: SourceDescription, req: ReshardRequest) -> Target:
    """The :class:`~.plan.Target` of ``req`` for ``src``: every row of :data:`RULES` checked in order (the first
    refusal raised), then the target's values as :class:`_Decided` decided them. No tensor I/O (AutoTP's
    ``config.json`` is read when the TP size changes)."""
    d = _Decided(src, req)
    for rule in RULES:
        message = rule.refuses(src, req, d)
        if message is not None:
            raise rule.error(message)
    facts = src.facts
    sub = req.sub_group_size
    if sub is None:
        sub = facts.sub_group_size if src.stage == 3 else DEFAULT_SUB_GROUP_SIZE
    return Target(
        zero_stage=d.stage, world_size=d.dp, parallel=d.parallel, optimizer_wrapper=d.wrapper,
        sub_group_size=sub if d.stage == 3 else req.sub_group_size,
        scalars_from=d.scalars_from, wording=d.wording,
        round_robin=req.round_robin if req.round_robin is not None else (facts.round_robin and src.stage != 3),
        parameter_alignment=(req.parameter_alignment if req.parameter_alignment is not None
                             else facts.parameter_alignment and src.stage != 3),
        stage0_rebuilt=d.stage0_rebuilt, moe_recut=d.moe_recut, autotp_meta=d.autotp_meta,
        total_world_size=req.world_size, copied_layer_files=d.copied_layer_files,
        recut_layer_files=d.recut_layer_files, model_parallel_notes=d.model_parallel_notes, precision=d.precision)
