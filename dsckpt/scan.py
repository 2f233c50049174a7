"""``scan``: find inf/NaN (and other suspicious) values in every stored tensor of a checkpoint.

:func:`plan_scan` decides what to read (pure: parsed file metadata in, frozen plan out);
:func:`run_scan` reads it, vectorised and in bounded chunks, each stored byte once.

What is read:

* every stored copy of every logical tensor, through the :class:`~dsckpt.model.LogicalCheckpoint`
  fragments (module weights and buffers in every model-states file, stage-3 buffer replicas,
  fp32 master partitions, ``exp_avg`` / ``exp_avg_sq``, frozen fragments, stage-0 ``optimizer``
  contents). Findings come back under the logical name with logical flat indices;
* then every other floating-point tensor region of the same files that no fragment covers
  (partition padding, optimizer ``step`` values, anything unrecognised) — reported as kind
  ``other`` with the stored key path and indices into that stored tensor;
* in a DeepSpeed checkpoint, every Python ``float`` of the parsed files (a loss scaler's scale, a
  scheduler's ``best``), read from the metadata already parsed.

A **finding** is about the model: params, buffers, 16-bit copies, fp32 masters, Adam moments and
DeepSpeed's own optimizer scalars. Non-finite values in *client state* — what a trainer keeps for itself
in the model-states file (Lightning's ``callbacks``/``loops``/``lr_schedulers``, a ``client_state``
passed to ``save_checkpoint``, DeepSpeed's ``lr_scheduler``), told apart by key path with
:func:`dsckpt.layout.key_owner` — are reported apart (:attr:`ScanReport.client_state`) and never
make a checkpoint unclean: ``ModelCheckpoint.kth_value`` and ``EarlyStopping.best_score`` start at +inf.

Checks:

* ``nonfinite``: NaN, +inf, -inf counts in every floating tensor;
* ``fp16_overflow``: finite fp32 master values with ``|x| > 65504`` (fp16's largest finite value) in
  a checkpoint trained in fp16 — the next step would turn them into inf in the fp16 weights;
* ``mismatch``: a 16-bit module copy of a param that is not ``master.to(lowp_dtype)``. Only compared
  where the master, its rounding to the 16-bit dtype and the stored 16-bit value are all finite: a
  non-finite 16-bit value is already a ``nonfinite`` finding and a master that overflows the 16-bit
  dtype an ``fp16_overflow`` one. DeepSpeed 0.19.8 copies the master into the 16-bit weights with
  ``.to()`` (round to nearest even) after every step, so any difference is real damage or a stale copy.

The work is split in three modules: :mod:`dsckpt.scan_plan` (the records and :func:`plan_scan`, pure),
:mod:`dsckpt.scan_engine` (reading and checking the planned chunks in worker threads or processes) and this one
(the front door: open a target, plan, run; and the ``--distributed`` spread).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .dtypes import dtype_info
from .model import LogicalCheckpoint
from .nonfinite import NonFinite
from .readers.common import FileCache
from .scan_engine import default_workers, scan_pass
from .scan_plan import (
    DEFAULT_CHUNK_NUMEL,
    FP16_MAX,
    Check,
    EntryScan,
    Finding,
    HealthCheck,
    HealthFinding,
    RawScan,
    ScanPlan,
    ScanReport,
    StoredKind,
    count_nonfinite,
    nonfinite_scalars,
    plan_scan,
    stored_kind,
)
from .state_dict_files import TargetKind, detect_target, open_state_dict

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "FP16_MAX",
    "Check",
    "EntryScan",
    "Finding",
    "HealthCheck",
    "HealthFinding",
    "NonFinite",
    "RawScan",
    "ScanPlan",
    "ScanReport",
    "StoredKind",
    "count_nonfinite",
    "default_workers",
    "nonfinite_scalars",
    "open_target",
    "plan_scan",
    "prepare_scan",
    "run_scan",
    "scan",
    "stored_kind",
]

def run_scan(plan: ScanPlan, cache: FileCache, *, on_progress: Callable[[int], None] | None = None,
             workers: int | None = None, processes: bool | None = None) -> ScanReport:
    """Read what ``plan`` names and report findings (the same, in the same order, whatever ``workers``).

    ``workers`` threads or worker processes (default :func:`default_workers`; 0 = this thread only; processes
    where :func:`dsckpt.scan_engine.use_processes` says, or as ``processes`` says) each read and check
    whole chunks -- every stored copy of ``plan.chunk_numel`` elements of one tensor, CRC-32 included --
    into buffers of their own, so memory is bounded by ``workers`` sets of chunk buffers."""
    zero: dict[tuple[str, str], bool] = {}
    findings, stored, totals = scan_pass(plan, cache, on_progress=on_progress, workers=workers,
                                         processes=processes, zero_states=zero)
    cache.finish_checks()  # CRC-32s of records read only partly (16-bit flat buffers' padding ...)
    return _report(plan, [*findings, *plan.scalars], len(stored), totals, zero)


def state_reset_findings(zero_states: dict[tuple[str, str], bool]) -> list[HealthFinding]:
    """Trained params whose per-element optimizer state (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer`` ...) is
    all zeros where a neighbour's same state is not: the state was reset (an optimizer rebuilt or a state dropped
    mid-run, silently). Pure. ``zero_states``: ``(param, state key) -> any value not zero``
    (:func:`dsckpt.scan_engine.scan_pass`).

    A *neighbour* is a param of the same module (``fc1.weight`` for ``fc1.bias``): a module all of whose params'
    states are zero is one that never received a gradient (a frozen module that an old DeepSpeed kept in its
    stage-0 optimizer, a Mixture-of-Experts expert no token was routed to), which the files cannot tell from a
    reset of the whole module, and is not reported."""
    def module(name: str) -> str:
        return name.rsplit(".", 1)[0] if "." in name else ""

    live = {(module(name), state) for (name, state), nonzero in zero_states.items() if nonzero}
    by_param: dict[str, list[str]] = {}
    for (name, state), nonzero in zero_states.items():
        if not nonzero and (module(name), state) in live:
            by_param.setdefault(name, []).append(state)
    return [HealthFinding(HealthCheck.STATE_RESET, name,
                          f"{name}: optimizer state {', '.join(states)} all zeros, while the rest of module "
                          f"'{module(name)}' trains: its state was reset (an optimizer rebuilt or its state dropped "
                          "mid-run, silently); a run resumed from here restarts its moments from zero")
            for name, states in by_param.items()]


def _report(plan: ScanPlan, found: list[Finding], stored_tensors: int, totals: tuple[int, int],
            zero_states: dict[tuple[str, str], bool] | None = None) -> ScanReport:
    health: list[HealthFinding] = []
    if plan.checks == (Check.NONFINITE,):  # --nonfinite: inf/NaN only; the training state is still shown
        pass
    elif plan.training is not None:
        health += [HealthFinding(HealthCheck.LOSS_SCALE, None, m) for m in plan.training.findings()]
    if zero_states and plan.checks != (Check.NONFINITE,):
        health += state_reset_findings(zero_states)
    return ScanReport(plan.target, plan.target_kind, plan.checks_run,
                      tuple(f for f in found if f.kind is not StoredKind.CLIENT_STATE), stored_tensors,
                      totals[0], totals[1],
                      client_state=tuple(f for f in found if f.kind is StoredKind.CLIENT_STATE),
                      training=plan.training, health=tuple(health))



# --------------------------------------------------------------------------------------------
# Front door


def open_target(target: str | os.PathLike[str], *, tag: str | None = None
                ) -> tuple[LogicalCheckpoint, FileCache, TargetKind]:
    """Open anything ``scan`` accepts: a DeepSpeed checkpoint, a ``.safetensors`` file, a sharded
    safetensors folder, a torch state-dict file, or a DCP folder."""
    kind = detect_target(target)
    if kind is TargetKind.DEEPSPEED:
        from .checkpoint import open_checkpoint

        c = open_checkpoint(target, tag=tag)
        return c.logical, c.cache, kind
    logical, cache = open_state_dict(target)
    return logical, cache, kind


def prepare_scan(target: str | os.PathLike[str], *, tag: str | None = None, nonfinite_only: bool = False,
                 chunk_numel: int | None = None) -> tuple[ScanPlan, FileCache]:
    """Open ``target`` (see :func:`open_target`), parse its files' metadata and plan the scan."""
    plan, cache, _ = prepare_scan_opened(target, tag=tag, nonfinite_only=nonfinite_only, chunk_numel=chunk_numel)
    return plan, cache


def prepare_scan_opened(target: str | os.PathLike[str], *, tag: str | None = None, nonfinite_only: bool = False,
                        chunk_numel: int | None = None) -> tuple[ScanPlan, FileCache, LogicalCheckpoint]:
    """:func:`prepare_scan`, and the logical checkpoint it opened."""
    logical, cache, kind = open_target(target, tag=tag)
    is_st = getattr(cache, "is_safetensors", lambda _f: False)
    # a DCP folder's files are read item by item (dsckpt.dcp_reader), never parsed whole
    trees = {} if kind is TargetKind.DCP else {f: cache.tree(f) for f in logical.files if not is_st(f)}
    plan = plan_scan(logical, trees, cache.tensor, target=Path(target), target_kind=kind,
                     nonfinite_only=nonfinite_only, chunk_numel=chunk_numel)
    if kind is TargetKind.DEEPSPEED:
        from .training_state import read_training_state

        plan = dataclasses.replace(plan, training=read_training_state(logical, cache))
    return plan, cache, logical


def scan(target: str | os.PathLike[str], *, tag: str | None = None, nonfinite_only: bool = False,
         chunk_numel: int | None = None,
         on_progress: Callable[[int], None] | None = None) -> ScanReport:
    """Scan ``target`` (see :func:`open_target`) and return every finding."""
    plan, cache = prepare_scan(target, tag=tag, nonfinite_only=nonfinite_only, chunk_numel=chunk_numel)
    return run_scan(plan, cache, on_progress=on_progress)


# --------------------------------------------------------------------------------------------
# --distributed


@dataclass(frozen=True)
class ScanItem:
    """One unit of distributed scan work: one logical tensor (``entries``: its index in
    ``ScanPlan.entries``), or every uncovered range of one stored tensor (``raw``: indices into
    ``ScanPlan.raw``; they share one tally, so one rank scans them all)."""

    entries: tuple[int, ...]
    raw: tuple[int, ...]
    nbytes: int


def plan_scan_items(plan: ScanPlan) -> tuple[ScanItem, ...]:
    """The plan's work items in report order (entries, then stored tensors by first uncovered range).
    Pure."""
    items = [ScanItem((i,), (), sum(p.numel * dtype_info(p.dtype).itemsize for p in e.pieces))
             for i, e in enumerate(plan.entries)]
    by_stored: dict[tuple[Path, tuple[Any, ...]], list[int]] = {}
    for k, r in enumerate(plan.raw):
        by_stored.setdefault((r.file, r.key), []).append(k)
    for ks in by_stored.values():
        items.append(ScanItem((), tuple(ks), sum(plan.raw[k].numel * dtype_info(plan.raw[k].dtype).itemsize
                                                 for k in ks)))
    return tuple(items)


def describe_scan_plan(plan: ScanPlan) -> dict[str, Any]:
    """What every rank must agree on (``Group.agree``): the plan's items, by name and size."""
    return {"target": str(plan.target), "checks": [c.value for c in plan.checks], "chunk": plan.chunk_numel,
            "entries": [[e.name, e.numel, [[p.label, p.dtype, p.numel] for p in e.pieces]]
                        for e in plan.entries],
            "raw": [[str(r.file), repr(r.key), r.start, r.numel, r.dtype] for r in plan.raw],
            "scalars": len(plan.scalars)}


def run_scan_distributed(plan: ScanPlan, cache: FileCache, group: Any, *,
                         on_progress: Callable[[int], None] | None = None, workers: int | None = None) -> ScanReport:
    """:func:`run_scan` spread over the ranks of ``group`` (:class:`dsckpt.distributed.Group`): the
    items of :func:`plan_scan_items` are split by bytes; each rank scans its share and sends findings to
    every rank; each zip record's CRC-32 is completed by the rank owning its file from every rank's
    segments. Every rank returns the report the one-process run returns (same findings, same order)."""
    from . import crc
    from .distributed import export_segments, owned_checks, record_checks, split_by_nbytes

    items = plan_scan_items(plan)
    group.agree(describe_scan_plan(plan), "the scan plan")
    mine = split_by_nbytes([it.nbytes for it in items], group.world_size)[group.rank]
    checks = record_checks(cache)
    item_of = _item_of(items, plan)

    def share() -> tuple[list[tuple[int, Finding]], set[tuple[Path, tuple[Any, ...]]], tuple[int, int], Any,
                         dict[tuple[str, str], bool]]:
        sub = dataclasses.replace(
            plan, entries=tuple(plan.entries[e] for i in mine for e in items[i].entries),
            raw=tuple(plan.raw[k] for k in sorted(k for i in mine for k in items[i].raw)), scalars=())
        # threads: this rank is one process of many already, and a fork would copy gloo's threads' locks
        zero: dict[tuple[str, str], bool] = {}
        found, stored, totals = scan_pass(sub, cache, on_progress=on_progress, workers=workers, processes=False,
                                          zero_states=zero)
        return [(item_of(f), f) for f in found], stored, totals, export_segments(checks), zero

    shares = group.step(share, "the scan")
    group.step(lambda: crc.finish(owned_checks(checks, [s[3] for s in shares], group)), "the CRC-32 checks")
    ordered = sorted((pair for s in shares for pair in s[0]), key=lambda pair: pair[0])
    stored_all: set[tuple[Path, tuple[Any, ...]]] = set().union(*(s[1] for s in shares))
    totals = (sum(s[2][0] for s in shares), sum(s[2][1] for s in shares))
    zero: dict[tuple[str, str], bool] = {}
    for s in shares:  # a param split over items of several ranks: zero only if zero in every one
        for k, nonzero in s[4].items():
            zero[k] = zero.get(k, False) or nonzero
    return _report(plan, [*(f for _, f in ordered), *plan.scalars], len(stored_all), totals, zero)


def _item_of(items: tuple[ScanItem, ...], plan: ScanPlan) -> Callable[[Finding], int]:
    name_to_item = {plan.entries[it.entries[0]].name: i for i, it in enumerate(items) if it.entries}
    stored_to_item = {(plan.raw[it.raw[0]].file, plan.raw[it.raw[0]].key): i for i, it in enumerate(items) if it.raw}
    return lambda f: name_to_item[f.name] if f.name is not None else stored_to_item[(f.file, f.key)]
