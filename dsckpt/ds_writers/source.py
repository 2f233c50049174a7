"""Phase 1 of a reshard plan: describe the source, once (``docs/design.md``).

:func:`describe_source` turns the logical checkpoint and the layout facts read from its rank-0 files
(:func:`~.facts.read_source_facts`) into one frozen :class:`SourceDescription`: its layout and ZeRO stage, optimizer
wrapper, precision, parallel sizes, the optimizer files a plan reads, whether it is an ``elastic_checkpoint`` save,
a universal folder, Muon's -- everything the target table (:mod:`.target`) and the planner ask -- and it refuses what
no target can be written from (:func:`~.facts.refusals_from_logical`). Nothing after it reads the source's
configuration again to learn what kind of source it is: it asks this record.

A new source kind (a DCP folder, next) is a new ``describe_*`` function giving the same record.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..errors import UnsupportedCheckpointError
from ..model import LogicalCheckpoint, Precision
from .facts import ELASTIC_NOTE, derive_facts, is_elastic, refusal_message, refusals_from_logical
from .plan import SourceFacts, source_layout_stage, source_optim_files

__all__ = ["SourceDescription", "describe_source"]


@dataclass(frozen=True)
class SourceDescription:
    """What every later phase knows about the source (decided once, by :func:`describe_source`).

    ``ckpt``: the logical checkpoint (names, shapes, where every stored copy of every tensor lies; its ``moe``,
    ``autoep``, ``pipeline`` and ``tensor_parallel`` records are the source's parallel layout). ``facts``: the layout
    facts of its rank-0 files. ``stage``: the ZeRO stage whose file layout it uses
    (:func:`~.plan.source_layout_stage`: a stage-0 ``BF16_Optimizer`` save is laid out as ZeRO-1). ``tp_size``: its
    tensor-parallel size (1 without). ``optim_files``: its per-rank optimizer files in rank order.
    ``bf16_prefixed_optim``: whether its ZeRO optimizer files carry DeepSpeed's ``bf16_`` prefix (the target's keep
    it). ``notes``: what every plan of it says (an elastic save's)."""

    ckpt: LogicalCheckpoint
    facts: SourceFacts
    stage: int
    wrapper: str
    precision: Precision
    tp_size: int
    elastic: bool
    universal: bool
    muon: bool
    optim_files: tuple[Path, ...]
    bf16_prefixed_optim: bool
    tied_keys: tuple[tuple[int, str], ...]
    notes: tuple[str, ...]

    @property
    def tag_dir(self) -> Path:
        return self.ckpt.tag_dir

    @property
    def pipeline(self) -> bool:
        return self.ckpt.pipeline is not None

    @property
    def tensor_parallel(self) -> bool:
        return self.ckpt.tensor_parallel is not None

    @property
    def moe(self) -> bool:
        return self.ckpt.moe is not None

    @property
    def autoep(self) -> bool:
        return self.ckpt.autoep is not None


def describe_source(ckpt: LogicalCheckpoint, facts: SourceFacts | None = None, *,
                    refuse: bool = True) -> SourceDescription:
    """The :class:`SourceDescription` of ``ckpt``; refuses (:class:`UnsupportedCheckpointError`, every problem in one
    message) a source no target can be written from -- unless ``refuse`` is false (a universal folder as the target,
    whose refusals are its own: :data:`.target.UNIVERSAL_RULES`). ``facts`` from :func:`~.facts.read_source_facts`;
    without it, derived from ``ckpt`` alone (:func:`~.facts.derive_facts`: enough for tests and dry runs)."""
    problems = refusals_from_logical(ckpt) if refuse else []
    if problems:
        raise UnsupportedCheckpointError(refusal_message(ckpt, problems))
    optim = source_optim_files(ckpt)
    zero_optim = [p for p in optim if "zero_pp_rank_" in p.name]
    elastic = is_elastic(ckpt)
    return SourceDescription(
        ckpt=ckpt, facts=facts if facts is not None else derive_facts(ckpt), stage=source_layout_stage(ckpt),
        wrapper=ckpt.optimizer_wrapper, precision=ckpt.precision, tp_size=max(1, ckpt.tp_world_size),
        elastic=elastic, universal=ckpt.layout.startswith("universal"),
        muon=any(g.hyperparam("use_muon") for g in ckpt.optimizer_groups), optim_files=optim,
        # DeepSpeed prefixes the ZeRO optimizer files whenever bf16 is enabled (engine.py:4319-4334); a source without
        # them (stage 0, whose MoE expp_rank_* files are never prefixed; a universal folder) says so through its
        # precision
        bf16_prefixed_optim=(any(p.name.startswith("bf16_") for p in zero_optim) if zero_optim
                             else ckpt.precision is Precision.BF16),
        tied_keys=ckpt.pipeline.tied_keys if ckpt.pipeline is not None else (),
        notes=(ELASTIC_NOTE,) if elastic else (),
    )
