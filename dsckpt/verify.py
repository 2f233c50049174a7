"""``verify``: audit a whole DeepSpeed checkpoint without converting it.

One pass over the metadata of every file, then one streaming pass over every stored tensor byte:

* **files** — every rank file present (the readers refuse an incomplete set), and all of them from the
  same save: tag, world sizes, global step/samples, DeepSpeed version and config, ZeRO stage,
  partition counts, loss scaler, optimizer hyper-parameters and Adam step counts agree across files;
* **records** — every zip record's CRC32 (legacy non-zip files have none: said, not failed);
* **partitions** — sizes and padding consistent with ``param_shapes`` and DeepSpeed's rules (the
  readers check this while building the logical checkpoint);
* **bindings** — every optimizer-side tensor's owner proven (:mod:`dsckpt.binding`);
* **replicas** — copies that must hold the same data (a param replicated on every tensor-parallel rank) are
  compared bit for bit, in bounded windows;
* **values** — every 16-bit copy equals its fp32 master rounded, no inf/NaN, no fp32 master beyond
  fp16's range in an fp16 run (the checks of :mod:`dsckpt.scan`, in the same pass). Non-finite values
  in client state (Lightning's callbacks, schedulers: :func:`dsckpt.layout.key_owner`) are listed
  apart and are not problems.

A problem is reported, not raised: the report lists them all. What cannot be read at all (missing
rank files, partitions that contradict ``param_shapes``, unparseable files) raises as in every
command.
"""

from __future__ import annotations

import enum
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import UsageError
from .readers import FileCache, read_checkpoint
from .readers.same_save import file_facts, same_save_problems
from .validate import is_pep440, unloadable_fields

if TYPE_CHECKING:
    from .scan import Finding

__all__ = ["Area", "Problem", "VerifyReport", "ds_version_problems", "is_pep440", "replica_disagreements", "verify"]


class Area(enum.Enum):
    FILES = "files"
    RECORDS = "records"
    PARTITIONS = "partitions"
    BINDINGS = "bindings"
    VALUES = "values"


@dataclass(frozen=True)
class Problem:
    area: Area
    where: str
    message: str

    def describe(self) -> str:
        return f"{self.where}: {self.message}" if self.where else self.message

    def to_dict(self) -> dict[str, str]:
        return {"area": self.area.value, "where": self.where, "message": self.message}


@dataclass(frozen=True)
class VerifyReport:
    target: Path
    tag: str
    files: tuple[Path, ...]
    records_checked: int
    nbytes_read: int
    stored_tensors: int
    problems: tuple[Problem, ...]
    notes: tuple[str, ...] = field(default_factory=tuple)
    # non-finite values in client state (scan's ScanReport.client_state): shown, never problems
    client_state: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return not self.problems

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": str(self.target), "tag": self.tag, "ok": self.ok,
            "files": [str(f) for f in self.files], "records_checked": self.records_checked,
            "nbytes_read": self.nbytes_read, "stored_tensors": self.stored_tensors,
            "areas": [a.value for a in Area],
            "problems": [p.to_dict() for p in self.problems], "notes": list(self.notes),
            "client_state_nonfinite": [f.to_dict() for f in self.client_state],
        }


# --------------------------------------------------------------------------------------------
# Records: checked while the value pass reads them, the rest in the same sweep


class _RecordAudit:
    """Every zip record of the checkpoint's files checked once: the records the value pass reads are
    checked as their bytes go by (their :class:`~dsckpt.crc.RecordCheck` collects instead of raising),
    then every record not verified that way (integer tensors, the pickle's small companions) is read.
    Problems are listed file by file, in file order."""

    def __init__(self, files: tuple[Path, ...], cache: FileCache) -> None:
        from .parsed_tree import walk_tensors

        self.files = files
        self.file_problems: dict[Path, list[str]] = {f: [] for f in files}
        self.checks: dict[Path, list[Any]] = {}
        for f in files:
            seen: dict[int, Any] = {}
            for _, ref in walk_tensors(cache.tree(f)):
                check = ref.storage.check
                if check is not None and id(check) not in seen:
                    check.sink = self.file_problems[f]
                    seen[id(check)] = check
            self.checks[f] = list(seen.values())
        self.records_checked = 0
        self.extra_nbytes = 0
        self.legacy: list[Path] = []

    def finish_files(self, files: list[Path]) -> dict[Path, tuple[int, int, list[str], bool]]:
        """Complete the checks of ``files`` and read their records no check covered; per file: (records
        checked, bytes read for that, problems, legacy file without CRCs)."""
        from . import crc

        crc.finish(c for f in files for c in self.checks[f])
        out: dict[Path, tuple[int, int, list[str], bool]] = {}
        for f in files:
            verified = [c for c in self.checks[f] if c.done]
            records = sum(1 for c in verified if c.ok)
            report = crc.check_file_records(f, skip=(c.record for c in verified))
            if not report.has_crc:
                out[f] = (records, 0, list(self.file_problems[f]), True)
                continue
            out[f] = (records + report.records - len(report.problems), report.nbytes_checked,
                      [*self.file_problems[f], *(p.message for p in report.problems)], False)
        return out

    def finish(self) -> list[tuple[str, str]]:
        return self.take(self.finish_files(list(self.files)))

    def take(self, per_file: dict[Path, tuple[int, int, list[str], bool]]) -> list[tuple[str, str]]:
        """Add up :meth:`finish_files`' results (of every file, from any rank) in file order."""
        problems: list[str] = []
        for f in self.files:
            records, extra, found, legacy = per_file[f]
            self.records_checked += records
            self.extra_nbytes += extra
            problems += found
            if legacy:
                self.legacy.append(f)
        return [(_where(m), m) for m in dict.fromkeys(problems)]

    def notes(self, root: Path) -> list[str]:
        if not self.legacy:
            return []
        names = ", ".join(str(f.relative_to(root)) for f in self.legacy)
        return [f"no CRC (legacy non-zip format): bit rot cannot be detected in {names}"]


def _where(message: str) -> str:
    """``file record`` from a CRC message (``'{path}: record '{name}' ...'``)."""
    path, _, rest = message.partition(": ")
    record = rest.split("'")[1] if rest.startswith("record '") else ""
    return f"{Path(path).name} {record}".strip()


# --------------------------------------------------------------------------------------------
# The audit


def verify(path: str | os.PathLike[str], *, tag: str | None = None,
           on_progress: Callable[[int], None] | None = None, workers: int | None = None,
           group: Any = None) -> VerifyReport:
    """Audit the checkpoint at ``path``; see the module docstring. Reads every stored byte once;
    ``workers`` threads read and check in parallel (see :func:`dsckpt.scan.run_scan`).

    ``group`` (a :class:`dsckpt.distributed.Group`, ``--distributed``): the value pass is split over its
    ranks by bytes (:func:`dsckpt.scan.run_scan_distributed`'s items); each file's records are completed
    and audited by the one rank owning the file, from every rank's CRC-32 segments. Every rank returns
    the report the one-process run returns."""
    from .scan import Check, plan_scan, run_scan
    from .state_dict_files import TargetKind, detect_target

    if detect_target(path) is not TargetKind.DEEPSPEED:
        if group is not None:
            raise UsageError("verify --distributed is for DeepSpeed checkpoints; verify a state dict or DCP folder "
                             "in one process")
        return _verify_state_dict(path, on_progress=on_progress, workers=workers)
    cache = FileCache()
    ckpt = read_checkpoint(path, tag=tag, cache=cache, allow_mixed_saves=True)
    problems: list[Problem] = []
    notes: list[str] = []

    # same save (every other command refuses a mixed set; verify lists what disagrees)
    trees = {f: cache.tree(f) for f in ckpt.files}
    facts = file_facts(ckpt.files, trees, ckpt.tag_dir)
    problems += [Problem(Area.FILES, fact, msg) for fact, msg in same_save_problems(facts)]
    problems += [Problem(Area.FILES, where, msg) for where, msg in ds_version_problems(trees, ckpt.tag_dir)]

    # bindings
    for amb in ckpt.ambiguities:
        problems.append(Problem(Area.BINDINGS, ", ".join(amb.names), amb.describe()))

    # one streaming pass: values (scan's checks) with every record's CRC checked as its bytes go by
    audit = _RecordAudit(ckpt.files, cache)
    plan = plan_scan(ckpt, trees, cache.tensor, target=ckpt.root, target_kind=TargetKind.DEEPSPEED)
    if group is None:
        report = run_scan(plan, cache, on_progress=on_progress, workers=workers)
        record_problems = audit.finish()
    else:
        report, record_problems = _distributed_pass(plan, cache, audit, group, on_progress=on_progress,
                                                    workers=workers)
    problems += [Problem(Area.RECORDS, where, msg) for where, msg in record_problems]
    for f in report.findings:
        problems.append(Problem(Area.VALUES, f.name or f"{f.file.name} {f.key_str}",
                                f"{f.check.value}: {f.describe()}"))
    problems += [Problem(Area.VALUES, name, msg)
                 for name, msg in replica_disagreements(ckpt, cache, workers=workers)]
    notes += audit.notes(ckpt.tag_dir)
    notes += ckpt.notes
    assert Check.MISMATCH in plan.checks
    return VerifyReport(ckpt.root, ckpt.tag, ckpt.files, audit.records_checked,
                        report.nbytes_read + audit.extra_nbytes, report.stored_tensors, tuple(problems), tuple(notes),
                        report.client_state)


def _verify_state_dict(path: str | os.PathLike[str], *, on_progress: Callable[[int], None] | None,
                       workers: int | None) -> VerifyReport:
    """:func:`verify` of a torch state-dict file, a safetensors file or folder, or a DCP folder: one streaming pass
    over every tensor (scan's checks), then every zip record read is CRC-checked (torch files, DCP items)."""
    from .errors import CorruptCheckpointError
    from .scan import open_target, plan_scan, run_scan
    from .state_dict_files import TargetKind

    logical, cache, kind = open_target(path)
    trees = {f: cache.tree(f) for f in logical.files} if kind is TargetKind.TORCH else {}
    plan = plan_scan(logical, trees, cache.tensor, target=Path(path), target_kind=kind)
    report = run_scan(plan, cache, on_progress=on_progress, workers=workers)
    problems = [Problem(Area.VALUES, f.name or f"{f.file.name} {f.key_str}", f"{f.check.value}: {f.describe()}")
                for f in report.findings]
    records = 0
    try:
        records = cache.finish_checks()
    except CorruptCheckpointError as e:
        problems.append(Problem(Area.RECORDS, _where(str(e)), str(e)))
    return VerifyReport(logical.root, logical.tag or kind.value, logical.files, records, report.nbytes_read,
                        report.stored_tensors, tuple(problems), (), report.client_state)


def ds_version_problems(trees: dict[Path, Any], tag_dir: Path) -> list[tuple[str, str]]:
    """``(where, message)`` for every ``ds_version`` (top level, and the optimizer state's own) that DeepSpeed's
    loader could not parse as a version."""
    from .errors import shorten

    out = []
    for path, tree in trees.items():
        for where, value in unloadable_fields(tree):
            message = (f"{shorten(value)} ({type(value).__name__}) is not a version DeepSpeed can parse "
                       "(packaging.version.parse: PEP 440); DeepSpeed's load_checkpoint would fail on it")
            out.append((f"{path.relative_to(tag_dir)} {where}", message))
    return out


REPLICA_WINDOW_NUMEL = 1 << 20


# Unsigned integers as wide as an element: comparing through them is comparing bit for bit.
_BITS = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def replica_disagreements(ckpt: Any, cache: FileCache, *, workers: int | None = None) -> list[tuple[str, str]]:
    """``(tensor name, message)`` for every stored copy that differs from the copy it must equal
    (:attr:`~dsckpt.model.Piece.same_as`) -- compared bit for bit (NaN payloads included),
    ``REPLICA_WINDOW_NUMEL`` elements at a time, ``workers`` copies at once (default: one per core, as
    :func:`dsckpt.scan.run_scan`; 0: this thread only)."""
    from .scan import default_workers

    pairs = []
    for e in ckpt.entries:
        if e.tied_to is not None:
            continue
        for p in e.pieces:
            if p.same_as is None:
                continue
            primary = next((q for q in e.pieces if q.copy_id == (p.role, p.state_key, p.same_as)), None)
            if primary is None or primary.dtype != p.dtype or primary.numel != p.numel:
                continue
            for f in (*primary.fragments, *p.fragments):  # parse every file here: the workers only look up
                cache.tensor(f.file, f.key)
            pairs.append((e.name, primary, p))
    workers = default_workers() if workers is None else workers
    if workers <= 0 or len(pairs) <= 1:
        found = [_replica_disagreement(name, a, b, cache) for name, a, b in pairs]
    else:
        with ThreadPoolExecutor(min(workers, len(pairs)), thread_name_prefix="dsckpt-replicas") as ex:
            found = list(ex.map(lambda pair: _replica_disagreement(pair[0], pair[1], pair[2], cache), pairs))
    return [(name, msg) for (name, _, _), msg in zip(pairs, found) if msg is not None]


def _replica_disagreement(name: str, primary: Any, p: Any, cache: FileCache) -> str | None:
    """Why replica ``p`` differs from ``primary``, or None when they are equal bit for bit."""
    import numpy as np

    from .diff import _PieceReader
    from .model import contiguous_fragments

    pool: dict[tuple[int, str], np.ndarray] = {}
    a = _PieceReader(primary, cache, name, pool, 0, REPLICA_WINDOW_NUMEL)
    b = _PieceReader(p, cache, name, pool, 1, REPLICA_WINDOW_NUMEL)
    count, first_index = 0, -1
    for lo in range(0, p.numel, REPLICA_WINDOW_NUMEL):
        hi = min(p.numel, lo + REPLICA_WINDOW_NUMEL)
        x, y = a.read(lo, hi), b.read(lo, hi)
        bits = _BITS.get(x.itemsize)
        if bits is not None:  # one integer compare per element (an any() over bytes is ~10x slower)
            differ = np.flatnonzero(x.view(bits) != y.view(bits))
        else:
            xb, yb = x.view(np.uint8).reshape(hi - lo, -1), y.view(np.uint8).reshape(hi - lo, -1)
            differ = np.flatnonzero((xb != yb).any(axis=1))
        if differ.size and first_index < 0:
            first_index = lo + int(differ[0])
        count += int(differ.size)
    if not count:
        return None
    runs = contiguous_fragments(p)  # name the file holding the first differing element
    file = next((f for f in runs if f.dst_offset <= first_index < f.dst_offset + f.numel), runs[0]).file.name
    return (f"replica {p.replica} of its {p.label} copy ({file}) differs from replica {p.same_as} in "
            f"{count} element(s), first at flat index {first_index}; copies that must be identical disagree")


def _distributed_pass(plan: Any, cache: FileCache, audit: _RecordAudit, group: Any, *,
                      on_progress: Callable[[int], None] | None, workers: int | None
                      ) -> tuple[Any, list[tuple[str, str]]]:
    """The value pass and the record audit of :func:`verify`, spread over ``group``'s ranks: each file's
    records are completed (from every rank's CRC-32 segments, by :func:`run_scan_distributed`) and
    audited by the rank owning the file; mismatches go to that file's problem list there."""
    from .distributed import owned_paths, record_checks
    from .scan import run_scan_distributed

    group.agree([str(f) for f in audit.files], "the files to verify")
    report = run_scan_distributed(plan, cache, group, on_progress=on_progress, workers=workers)
    checks = record_checks(cache)
    owned = owned_paths(checks, group)
    with_checks = {c.path for c in checks}
    # files holding no record check (legacy non-zip files, files without tensors): rank 0 audits them
    mine = [f for f in audit.files if f in owned or (f not in with_checks and group.is_root)]
    parts = group.step(lambda: audit.finish_files(mine), "the CRC-32 audit")
    return report, audit.take({f: v for part in parts for f, v in part.items()})
