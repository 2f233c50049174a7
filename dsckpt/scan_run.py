"""``scan --all``: every checkpoint of a run, scanned one after the other, in step order.

A run is a DeepSpeed save dir, a Trainer ``output_dir`` or a Lightning ``dirpath``
(:func:`dsckpt.scan_record.list_run_checkpoints`). Each checkpoint is opened, planned and scanned exactly as
``scan`` scans one (:func:`dsckpt.scan.prepare_scan`, :func:`dsckpt.scan.run_scan`: same speed per byte), then its
parsed files are dropped before the next one is opened, so memory stays what one checkpoint's scan needs whatever
the run's length; what is kept per checkpoint is its :class:`RunEntry` (a few hundred bytes).

Per checkpoint, and never the end of the run's scan:

* a damaged, unreadable or half-written checkpoint is a line of its own (``unreadable``, ``incomplete``);
* one whose files change while it is read (a save in progress, a cleanup) is ``changed``;
* one holding another model than the run's other checkpoints (another run's save in the same folder) is
  ``unrelated`` and takes no part in *last clean* / *first with findings*;
* where the checkpoint's scan record (:mod:`dsckpt.scan_record`, written by ``watch`` and the callbacks) is there
  and its files are unchanged, its result is reused instead of reading the checkpoint again.

Nothing is written into the run.
"""

from __future__ import annotations

import enum
import hashlib
import logging
import os
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from .errors import DsckptError, UsageError
from .scan_record import (
    RunCheckpoint,
    RunCheckpointKind,
    completeness_problem,
    fingerprint,
    list_run_checkpoints,
    load_valid_record,
)

__all__ = ["MAX_DETAILS", "RunEntry", "RunScanReport", "RunStatus", "check_checkpoint", "scan_run"]

logger = logging.getLogger(__name__)

#: Finding lines kept per checkpoint (the count is always exact).
MAX_DETAILS = 20


class RunStatus(enum.Enum):
    CLEAN = "clean"
    FINDINGS = "findings"
    INCOMPLETE = "incomplete"  # not completely written (no 'latest' naming it, rank files missing)
    UNREADABLE = "unreadable"  # damaged, unsupported, deleted while listed
    CHANGED = "changed"  # its files changed while they were read
    UNRELATED = "unrelated"  # another model than the run's other checkpoints


@dataclass(frozen=True)
class RunEntry:
    """One checkpoint's line. ``findings`` counts findings (tensor findings plus training-state findings, plus one
    for an incomplete, unreadable or changed checkpoint); ``details`` names the first :data:`MAX_DETAILS`."""

    path: Path
    step: int | None
    kind: str
    status: RunStatus
    findings: int
    details: tuple[str, ...] = ()
    loss_scale: float | None = None
    loss_scale_floor: float | None = None
    skipped_steps: int | None = None
    global_steps: int | None = None
    checks: tuple[str, ...] = ()
    nbytes_read: int = 0
    model_signature: str | None = None
    reused_record: bool = False
    notes: tuple[str, ...] = ()
    nonfinite_only: bool = False  # scanned with --nonfinite (a record of it does not stand for a full scan)
    summary: str = ""  # one line: what was found, shortest form

    @property
    def clean(self) -> bool:
        return self.status is RunStatus.CLEAN

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "kind": self.kind, "status": self.status.value,
                "clean": self.clean, "findings": self.findings, "details": list(self.details),
                "loss_scale": self.loss_scale, "loss_scale_floor": self.loss_scale_floor,
                "skipped_steps": self.skipped_steps, "global_steps": self.global_steps, "checks": list(self.checks),
                "nbytes_read": self.nbytes_read, "model_signature": self.model_signature,
                "reused_record": self.reused_record, "notes": list(self.notes), "nonfinite_only": self.nonfinite_only,
                "summary": self.summary}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> RunEntry:
        """The entry a scan record's ``result`` holds (:meth:`to_dict`); raises KeyError/ValueError/TypeError."""
        return cls(Path(d["path"]), d["step"], str(d["kind"]), RunStatus(d["status"]), int(d["findings"]),
                   tuple(str(x) for x in d["details"]), d["loss_scale"], d["loss_scale_floor"], d["skipped_steps"],
                   d["global_steps"], tuple(str(c) for c in d["checks"]), int(d["nbytes_read"]),
                   d["model_signature"], bool(d.get("reused_record", False)), tuple(str(n) for n in d["notes"]),
                   bool(d["nonfinite_only"]), str(d["summary"]))


@dataclass(frozen=True)
class RunScanReport:
    run: Path
    checkpoints: tuple[RunEntry, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)

    @property
    def last_clean(self) -> RunEntry | None:
        return next((e for e in reversed(self.checkpoints) if e.clean), None)

    @property
    def first_with_findings(self) -> RunEntry | None:
        return next((e for e in self.checkpoints if not e.clean and e.status is not RunStatus.UNRELATED), None)

    @property
    def clean(self) -> bool:
        return all(e.clean for e in self.checkpoints)

    def to_dict(self) -> dict[str, Any]:
        lc, ff = self.last_clean, self.first_with_findings
        return {"run": str(self.run), "checkpoints": [e.to_dict() for e in self.checkpoints],
                "last_clean": None if lc is None else str(lc.path),
                "first_with_findings": None if ff is None else str(ff.path),
                "clean": self.clean, "notes": list(self.notes)}


def _signature(logical: Any) -> str:
    """What makes two checkpoints saves of one model: every tensor's name and shape (not values, dtypes or world
    sizes, which a resumed run may change)."""
    h = hashlib.sha256()
    for e in sorted(logical.entries, key=lambda e: e.name):
        h.update(f"{e.name}\0{tuple(e.shape)}\0{e.kind.value}\n".encode("utf-8", "surrogateescape"))
    return h.hexdigest()[:16]


def check_checkpoint(ckpt: RunCheckpoint, *, nonfinite_only: bool = False, workers: int | None = None,
                     use_record: bool = True, on_progress: Callable[[int], None] | None = None) -> RunEntry:
    """Scan one checkpoint of a run (as ``scan`` does) and describe the result as a :class:`RunEntry`; never raises
    for a bad checkpoint (that is the entry's status). ``use_record``: reuse the checkpoint's valid scan record
    when it covers the checks asked for. ``watch`` and the callbacks write ``entry.to_dict()`` as the record's
    result (:func:`dsckpt.scan_record.write_record`)."""
    from .scan import prepare_scan_opened, run_scan

    kind = ckpt.kind.value
    base = RunEntry(ckpt.path, ckpt.step, kind, RunStatus.UNREADABLE, 1, nonfinite_only=nonfinite_only)
    notes: list[str] = []
    if use_record:
        result = load_valid_record(ckpt.path)
        if result is not None:
            try:
                entry = RunEntry.from_dict(result)
            except (KeyError, ValueError, TypeError):
                entry = None
            if entry is not None and (nonfinite_only or not entry.nonfinite_only):
                return replace(entry, path=ckpt.path, kind=kind, reused_record=True)
    if not ckpt.path.exists():
        why = f"'{ckpt.path}' was deleted after the run was listed (a cleanup such as save_total_limit?)"
        return replace(base, details=(why,), summary=f"unreadable: {why}")
    # a save dir without 'latest' at all (save_latest=False, or never finished): each tag is scanned as it is
    save_dir_tag = ckpt.kind is RunCheckpointKind.DEEPSPEED_TAG
    if save_dir_tag and ckpt.path.is_dir() and not (ckpt.path.parent / "latest").is_file():
        notes.append("the save dir holds no 'latest': whether this save finished cannot be told")
    problem = completeness_problem(ckpt.path, require_latest=not save_dir_tag)
    try:
        before = fingerprint(ckpt.path)
        plan, cache, logical = prepare_scan_opened(ckpt.path, nonfinite_only=nonfinite_only)
        signature = _signature(logical)
        del logical
        report = run_scan(plan, cache, on_progress=on_progress, workers=workers)
        del plan, cache
        after = fingerprint(ckpt.path)
    except (DsckptError, OSError) as e:
        msg = str(e) if isinstance(e, DsckptError) else f"{e.filename or ckpt.path}: {e.strerror or e}"
        status = RunStatus.INCOMPLETE if problem is not None else RunStatus.UNREADABLE
        why = problem or msg
        return replace(base, status=status, details=(why,), notes=tuple(notes), summary=f"{status.value}: {why}")
    training = report.training
    ls = training.loss_scaler if training is not None else None
    details = [f"{f.check.value} {f.describe()}" for f in report.findings[:MAX_DETAILS]]
    details += [f"{h.check.value} {h.describe()}" for h in report.health][: max(0, MAX_DETAILS - len(details))]
    count = len(report.findings) + len(report.health)
    short = [_short(f) for f in report.findings] + [
        f"{h.check.value} {h.name}" if h.name else
        f"{h.check.value} {ls.scale:g} at its floor" if ls is not None else h.check.value for h in report.health]
    status = RunStatus.CLEAN if report.clean else RunStatus.FINDINGS
    if problem is not None:
        status, count = RunStatus.INCOMPLETE, count + 1
        details.insert(0, f"incomplete: {problem}")
        short.insert(0, f"incomplete: {problem}")
    if before != after:
        status, count = RunStatus.CHANGED, count + 1
        why = "changed: its files changed while they were read (a save or a cleanup in progress?); scan it again"
        details.insert(0, why)
        short.insert(0, why)
    shown = short[:3] + ([f"{len(short) - 3} more"] if len(short) > 3 else [])
    summary = "clean" if status is RunStatus.CLEAN else f"{count} finding(s): " + "; ".join(shown)
    return RunEntry(ckpt.path, ckpt.step if training is None or training.global_steps is None
                    else training.global_steps, kind, status, count, tuple(details[:MAX_DETAILS]),
                    None if ls is None else ls.scale, None if ls is None else ls.floor,
                    None if training is None else training.skipped_steps,
                    None if training is None else training.global_steps,
                    tuple(c.value for c in report.checks), report.nbytes_read, signature, False, tuple(notes),
                    nonfinite_only, summary)


def _short(f: Any) -> str:
    what = f.name if f.name is not None else f"{f.file.name} {f.key_str}"
    counts = ", ".join(f"{n} {label}" for n, label in ((f.nan, "NaN"), (f.posinf, "+inf"), (f.neginf, "-inf")) if n)
    return f"{f.check.value} {what} ({f.kind.value}" + (f", {counts})" if counts else f", {f.count} values)")


def scan_run(run_path: str | os.PathLike[str], *, nonfinite_only: bool = False, workers: int | None = None,
             use_records: bool = True, on_checkpoint: Callable[[RunCheckpoint], None] | None = None,
             on_progress: Callable[[int], None] | None = None) -> RunScanReport:
    """Scan every checkpoint of the run at ``run_path`` (see the module docstring). Raises :class:`UsageError`
    when ``run_path`` holds no checkpoint. ``on_checkpoint`` is called before each checkpoint is scanned."""
    run = Path(run_path)
    listed = list_run_checkpoints(run)
    if not listed:
        raise UsageError(f"'{run}' holds no checkpoint: scan --all takes a DeepSpeed save dir (tag folders), a Trainer "
                         "output_dir (checkpoint-N folders) or a Lightning dirpath (*.ckpt)")
    entries: list[RunEntry] = []
    for c in listed:
        if on_checkpoint is not None:
            on_checkpoint(c)
        entries.append(check_checkpoint(c, nonfinite_only=nonfinite_only, workers=workers, use_record=use_records,
                                        on_progress=on_progress))
    entries = _mark_unrelated(entries)
    return RunScanReport(run, tuple(entries))


def _mark_unrelated(entries: list[RunEntry]) -> list[RunEntry]:
    """The run's model is the signature most checkpoints share (the newest one's on a tie); the others are
    another run's saves."""
    sigs = [e.model_signature for e in entries if e.model_signature is not None]
    if len(set(sigs)) <= 1:
        return entries
    counts = Counter(sigs)
    best = max(counts.values())
    run_sig = next(s for s in reversed(sigs) if counts[s] == best)
    out = []
    for e in entries:
        if e.model_signature is not None and e.model_signature != run_sig:
            why = ("unrelated: holds another model (other tensor names or shapes) than the run's other "
                   f"{counts[run_sig]} checkpoint(s): a save of another run in this folder?")
            e = replace(e, status=RunStatus.UNRELATED, findings=e.findings + 1,
                        details=(why, *e.details)[:MAX_DETAILS], summary=why)
        out.append(e)
    return out
