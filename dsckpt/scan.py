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
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import heapq
import logging
import math
import os
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import safe_load
from .chunks import fragment_views, place
from .dtypes import DTYPES, dtype_info, from_float32, to_float32
from .errors import CorruptCheckpointError
from .layout import Owner, key_owner
from .model import (
    Fragment,
    Kind,
    LogicalCheckpoint,
    Piece,
    Precision,
    Role,
    TensorEntry,
    reading_fragments,
)
from .nonfinite import NonFinite
from .readers.common import FileCache, format_key, lookup
from .safe_load import TensorRef
from .state_dict_files import TargetKind, detect_target, open_state_dict

if TYPE_CHECKING:
    import torch

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "FP16_MAX",
    "Check",
    "EntryScan",
    "Finding",
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

FP16_MAX = 65504.0
# 512K elements: 2 MiB per fp32 buffer, ~7 MiB for the four stored copies of a bf16 + Adam tensor, per
# worker thread; big enough that per-chunk Python work stays small next to the bytes it checks.
DEFAULT_CHUNK_NUMEL = 1 << 19
# Without the master/16-bit comparison a chunk's stored copies are checked one after the other through
# one buffer, so chunks twice as long fit the same memory (4 MiB of data + 4 MiB of exponent bits per
# worker) and halve the GIL round trips per byte, which is what bounds eight threads (issue 12).
NONFINITE_CHUNK_NUMEL = 1 << 20
MAX_INDICES = 8


class Check(enum.Enum):
    NONFINITE = "nonfinite"
    FP16_OVERFLOW = "fp16_overflow"
    MISMATCH = "mismatch"


class StoredKind(enum.Enum):
    """What a stored copy is, as reported to users."""

    PARAM = "param"
    BUFFER = "buffer"
    FROZEN = "frozen"
    MASTER = "fp32 master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    OTHER = "other"
    CLIENT_STATE = "client state"  # reported apart, never a finding (see the module docstring)


def count_nonfinite(t: torch.Tensor) -> tuple[int, int, int]:
    """``(nan, +inf, -inf)`` counts of a floating torch tensor (vectorised; torch paths only)."""
    import torch

    if not t.is_floating_point():
        return 0, 0, 0
    # Any NaN/inf makes the sum NaN/inf, so a finite sum proves every value finite; one reduction
    # pass is ~10x cheaper than materialising isfinite(t). A finite tensor whose sum overflows only
    # falls through to the exact count below.
    acc = torch.float64 if t.dtype == torch.float64 else torch.float32
    if bool(torch.isfinite(torch.sum(t, dtype=acc))) or bool(torch.isfinite(t).all()):
        return 0, 0, 0
    return int(torch.isnan(t).sum()), int(torch.isposinf(t).sum()), int(torch.isneginf(t).sum())


def stored_kind(entry: TensorEntry | None, role: Role | None) -> StoredKind:
    if entry is None or role is None:
        return StoredKind.OTHER
    if role is Role.MASTER:
        return StoredKind.MASTER
    if role is Role.EXP_AVG:
        return StoredKind.EXP_AVG
    if role is Role.EXP_AVG_SQ:
        return StoredKind.EXP_AVG_SQ
    if entry.kind is Kind.BUFFER:
        return StoredKind.BUFFER
    return StoredKind.PARAM if entry.trainable else StoredKind.FROZEN


@dataclass(frozen=True)
class Finding:
    """Suspicious values in one stored copy of one tensor, in one file.

    ``first_indices`` are flat indices into the logical tensor ``name`` (into the stored tensor at
    ``key`` when ``name`` is None; into the rows ``padding_rows = (first, end)`` of the stored tensor, past
    its logical shape, for vocabulary padding, :attr:`~dsckpt.model.TensorEntry.padding`). For
    ``nonfinite``, ``count == nan + posinf + neginf``.
    """

    check: Check
    name: str | None
    file: Path
    key: tuple[Any, ...]
    kind: StoredKind
    dtype: str
    count: int
    numel: int
    first_indices: tuple[int, ...]
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    rank: int | None = None
    replica: int = 0
    aliases: tuple[str, ...] = ()
    padding_rows: tuple[int, int] | None = None

    @property
    def key_str(self) -> str:
        return format_key(self.key)

    def describe(self) -> str:
        if self.kind is StoredKind.CLIENT_STATE:
            return (f"client state {self.file.name} {self.key_str}: {self.dtype}, {self._counts()} of "
                    f"{self.numel} values; kept by the trainer, not model data (not a finding)")
        what = self.name if self.name is not None else f"(no tensor) {self.key_str}"
        if self.padding_rows is not None:
            what += f" vocabulary padding rows {self.padding_rows[0]}-{self.padding_rows[1] - 1}"
        if self.check is Check.NONFINITE:
            detail = self._counts()
        elif self.check is Check.FP16_OVERFLOW:
            detail = f"{self.count} values with |x| > {FP16_MAX:g} (overflow fp16)"
        else:
            detail = f"{self.count} values differ from the fp32 master rounded to {self.dtype}"
        alias = f" (tied: {', '.join(self.aliases)})" if self.aliases else ""
        return (f"{what}{alias}: {self.kind.value}, {self.dtype}, {detail} of {self.numel} values; "
                f"in {self.file.name} {self.key_str}; first indices {list(self.first_indices)}")

    def _counts(self) -> str:
        return ", ".join(f"{n} {label}" for n, label in ((self.nan, "NaN"), (self.posinf, "+inf"),
                                                          (self.neginf, "-inf")) if n)

    def to_dict(self) -> dict[str, Any]:
        return {
            "check": self.check.value, "name": self.name, "file": str(self.file), "key": self.key_str,
            "kind": self.kind.value, "dtype": self.dtype, "count": self.count, "numel": self.numel,
            "nan": self.nan, "posinf": self.posinf, "neginf": self.neginf,
            "first_indices": list(self.first_indices), "rank": self.rank, "replica": self.replica,
            "aliases": list(self.aliases),
            "padding_rows": list(self.padding_rows) if self.padding_rows is not None else None,
        }


@dataclass(frozen=True)
class EntryScan:
    """Read every stored copy of one logical tensor, chunk by chunk in logical order."""

    name: str
    numel: int
    pieces: tuple[Piece, ...]
    kinds: tuple[StoredKind, ...]
    overflow_pieces: tuple[int, ...]  # indices into pieces: fp32 masters of an fp16 run
    compare: tuple[int, int] | None  # (master piece, 16-bit module piece) to compare
    aliases: tuple[str, ...] = ()
    padding_rows: tuple[int, int] | None = None  # the entry's vocabulary padding rows, not the tensor itself


@dataclass(frozen=True)
class RawScan:
    """``numel`` elements from ``start`` of the stored tensor at ``key`` that no fragment covers."""

    file: Path
    key: tuple[Any, ...]
    start: int
    numel: int
    dtype: str
    # Stage-3 partition padding: the tail of a partition whose head holds tensor data. DeepSpeed
    # allocates partitions with torch.empty and copies only the data (partition_parameters.py
    # _partition_param, 0.10.3 to 0.19.8), so these bytes are leftover memory: read, never reported.
    partition_padding: bool = False
    client_state: bool = False  # layout.key_owner: reported apart, never a finding


@dataclass(frozen=True)
class ScanPlan:
    target: Path
    target_kind: TargetKind
    checks: tuple[Check, ...]
    entries: tuple[EntryScan, ...]
    raw: tuple[RawScan, ...]
    nbytes: int
    chunk_numel: int = DEFAULT_CHUNK_NUMEL
    scalars: tuple[Finding, ...] = ()  # non-finite Python floats, found while planning (nonfinite_scalars)


@dataclass(frozen=True)
class ScanReport:
    target: Path
    target_kind: TargetKind
    checks: tuple[Check, ...]
    findings: tuple[Finding, ...]
    stored_tensors: int
    numel_scanned: int
    nbytes_read: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    # non-finite values in client state (kind CLIENT_STATE): shown apart, never findings
    client_state: tuple[Finding, ...] = field(default_factory=tuple)

    @property
    def clean(self) -> bool:
        return not self.findings

    def of(self, check: Check) -> list[Finding]:
        return [f for f in self.findings if f.check is check]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": str(self.target), "target_kind": self.target_kind.value,
            "checks": [c.value for c in self.checks], "clean": self.clean,
            "stored_tensors": self.stored_tensors, "numel_scanned": self.numel_scanned,
            "nbytes_read": self.nbytes_read, "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes), "client_state_nonfinite": [f.to_dict() for f in self.client_state],
        }


# --------------------------------------------------------------------------------------------
# Planning


def plan_scan(logical: LogicalCheckpoint, trees: Mapping[Path, Any], refs: Callable[[Path, tuple[Any, ...]], Any], *,
              target: Path, target_kind: TargetKind, nonfinite_only: bool = False,
              chunk_numel: int | None = None) -> ScanPlan:
    """Decide what to read. Pure: ``trees`` are the parsed files (tensors as TensorRef, no data) and
    ``refs(file, key)`` returns the stored-tensor reference a fragment points at. ``chunk_numel``:
    elements per chunk (default :data:`NONFINITE_CHUNK_NUMEL` with ``nonfinite_only``, else
    :data:`DEFAULT_CHUNK_NUMEL`)."""
    if chunk_numel is None:
        chunk_numel = NONFINITE_CHUNK_NUMEL if nonfinite_only else DEFAULT_CHUNK_NUMEL
    checks = (Check.NONFINITE,) if nonfinite_only else (Check.NONFINITE, Check.FP16_OVERFLOW, Check.MISMATCH)
    aliases: dict[str, list[str]] = {}
    for e in logical.entries:
        if e.tied_to is not None:
            aliases.setdefault(e.tied_to, []).append(e.name)
    entries = []
    nbytes = 0
    for e in logical.entries:
        if e.tied_to is not None:
            continue
        # The tensor, then its vocabulary padding rows (stored, trained values past its logical shape).
        padding = ((e.padding, e.padding_numel, (e.shape[0], e.shape[0] + e.padding_rows)),) if e.padding else ()
        for all_pieces, numel, rows in ((e.pieces, e.numel, None), *padding):
            pieces = _distinct_pieces(tuple(p for p in all_pieces if dtype_info(p.dtype).is_floating), refs)
            if not pieces:
                continue
            kinds = tuple(stored_kind(e, p.role) for p in pieces)
            overflow = tuple(i for i, p in enumerate(pieces)
                             if Check.FP16_OVERFLOW in checks and logical.precision is Precision.FP16
                             and p.role is Role.MASTER and p.dtype == "float32")
            compare = None
            if Check.MISMATCH in checks:
                m = next((i for i, p in enumerate(pieces) if p.role is Role.MASTER and p.dtype == "float32"), None)
                lp = next((i for i, p in enumerate(pieces)
                           if p.role is Role.MODULE and p.replica == 0 and p.dtype in ("float16", "bfloat16")), None)
                if m is not None and lp is not None:
                    compare = (m, lp)
            entries.append(EntryScan(e.name, numel, pieces, kinds, overflow, compare, tuple(aliases.get(e.name, ())),
                                     rows))
            nbytes += sum(p.numel * dtype_info(p.dtype).itemsize for p in pieces)
    raw = _uncovered(logical, trees, refs)
    nbytes += sum(r.numel * dtype_info(r.dtype).itemsize for r in raw)
    scalars = nonfinite_scalars(trees) if target_kind is TargetKind.DEEPSPEED else ()
    return ScanPlan(target, target_kind, checks, tuple(entries), tuple(raw), nbytes, chunk_numel, scalars)


def nonfinite_scalars(trees: Mapping[Path, Any]) -> tuple[Finding, ...]:
    """Non-finite Python ``float`` values of the parsed files (not tensors: a ReduceLROnPlateau
    ``best``, a loss scaler's ``cur_scale``), each a one-value ``nonfinite`` finding of kind ``other``,
    or ``client state`` where :func:`~dsckpt.layout.key_owner` says so; configuration (``ds_config``,
    where the HF Trainer writes ``steps_per_print: inf``) is skipped. Pure."""
    out: list[Finding] = []

    def visit(x: Any, path: Path, key: tuple[Any, ...]) -> None:
        if isinstance(x, float):
            owner = key_owner(path.name, key)
            if not math.isfinite(x) and owner is not Owner.CONFIG:
                kind = StoredKind.CLIENT_STATE if owner is Owner.CLIENT_STATE else StoredKind.OTHER
                nan, pos = int(math.isnan(x)), int(x == math.inf)
                out.append(Finding(Check.NONFINITE, None, path, key, kind, "python float", 1, 1, (0,),
                                   nan, pos, 1 - nan - pos))
        elif isinstance(x, dict):
            for k, v in x.items():
                visit(v, path, (*key, k))
        elif isinstance(x, (list, tuple)):
            for i, v in enumerate(x):
                visit(v, path, (*key, i))
        elif isinstance(x, safe_load.DeepSpeedObject):
            for k, v in x.__dict__.items():
                visit(v, path, (*key, k))

    for path, tree in trees.items():
        visit(tree, path, ())
    return tuple(out)


def _distinct_pieces(pieces: tuple[Piece, ...], refs: Callable[[Path, tuple[Any, ...]], Any]) -> tuple[Piece, ...]:
    """Drop pieces stored in the very same bytes as an earlier one (stage-2 ``frozen_param_fragments``
    entries are the module tensors themselves, pickled twice into one storage)."""
    seen: set[tuple[Any, ...]] = set()
    out = []
    for p in pieces:
        sig: list[tuple[Any, ...]] = []
        for f in p.fragments:
            ref = refs(f.file, f.key)
            strides = (f.run_numel, f.src_stride, f.dst_stride)
            if isinstance(ref, TensorRef) and ref.is_contiguous():
                sig.append((f.file, ref.storage.key, ref.storage_offset + f.src_offset, f.numel, f.dst_offset, strides))
            else:
                sig.append((f.file, f.key, f.src_offset, f.numel, f.dst_offset, strides))
        if tuple(sig) not in seen:
            seen.add(tuple(sig))
            out.append(p)
    return tuple(out)


_REAL_FLOATING = frozenset({"float64", "float32", "float16", "bfloat16"})  # torch's is_floating_point


def _uncovered(logical: LogicalCheckpoint, trees: Mapping[Path, Any],
               refs: Callable[[Path, tuple[Any, ...]], Any]) -> list[RawScan]:
    """Floating-point regions of the parsed files that no fragment of ``logical`` covers.

    Works in storage coordinates, so views sharing bytes (tied weights, the 16-bit flat buffer)
    are read once; each uncovered region is attributed to the first view (in file order) over it.
    """
    covered: dict[tuple[Path, str], list[tuple[int, int]]] = {}
    covered_views: set[tuple[Path, tuple[Any, ...]]] = set()
    for e in logical.entries:
        if e.tied_to is not None:
            continue
        for p in (*e.pieces, *e.padding):
            for f in p.fragments:
                ref = refs(f.file, f.key)
                if not isinstance(ref, TensorRef):
                    continue
                if ref.is_contiguous():
                    for g in f.runs() if f.src_strided else (f,):  # a strided source covers its runs, not its gaps
                        start = ref.storage_offset + g.src_offset
                        covered.setdefault((f.file, ref.storage.key), []).append((start, start + g.numel))
                else:
                    covered_views.add((f.file, f.key))
    out: list[RawScan] = []
    for path, tree in trees.items():
        views: dict[str, list[tuple[int, int, int, tuple[Any, ...], TensorRef]]] = {}
        for order, (key, ref) in enumerate(safe_load.walk_tensors(tree)):
            if ref.dtype_name not in _REAL_FLOATING or ref.numel == 0 or (path, key) in covered_views:
                continue
            if not ref.is_contiguous():
                out.append(RawScan(path, key, 0, ref.numel, ref.dtype_name, client_state=_is_client(path, key)))
                continue
            views.setdefault(ref.storage.key, []).append(
                (ref.storage_offset, ref.storage_offset + ref.numel, order, key, ref))
        for skey, vs in views.items():
            spans = sorted(covered.get((path, skey), []))
            raw = _uncovered_in_storage(path, vs, spans)
            if logical.zero_stage == 3:
                partly = {key for a, b, _, key, _ in vs if any(x < b and y > a for x, y in spans)}
                raw = [dataclasses.replace(r, partition_padding=True) if r.key in partly else r for r in raw]
            out += [dataclasses.replace(r, client_state=True) if _is_client(path, r.key) else r for r in raw]
    return out


def _is_client(path: Path, key: tuple[Any, ...]) -> bool:
    return key_owner(path.name, key) is Owner.CLIENT_STATE


def _uncovered_in_storage(path: Path, views: list[tuple[int, int, int, tuple[Any, ...], TensorRef]],
                          covered: list[tuple[int, int]]) -> list[RawScan]:
    merged: list[list[int]] = []
    for a, b in covered:
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    bounds = sorted({x for v in views for x in v[:2]} | {x for m in merged for x in m})
    starts = sorted(views, key=lambda v: v[0])
    active: list[tuple[int, int]] = []  # heap of (order, index into starts)
    out: list[RawScan] = []
    vi = mi = 0
    for lo, hi in zip(bounds, bounds[1:]):
        while vi < len(starts) and starts[vi][0] <= lo:
            heapq.heappush(active, (starts[vi][2], vi))
            vi += 1
        while active and starts[active[0][1]][1] <= lo:
            heapq.heappop(active)
        while mi < len(merged) and merged[mi][1] <= lo:
            mi += 1
        if not active or (mi < len(merged) and merged[mi][0] <= lo):
            continue
        _, i = active[0]
        vstart, _, _, key, ref = starts[i]
        dtype = ref.dtype_name
        if out and out[-1].key == key and out[-1].start + out[-1].numel == lo - vstart:
            last = out.pop()
            out.append(RawScan(path, key, last.start, last.numel + hi - lo, dtype))
        else:
            out.append(RawScan(path, key, lo - vstart, hi - lo, dtype))
    return out


# --------------------------------------------------------------------------------------------
# Running: numpy only; chunks are read and checked in worker threads (``os.preadv``, ``zlib.crc32``
# and numpy's loops release the GIL), results are tallied here in plan order.

MAX_WORKERS = 8


def default_workers() -> int:
    """Threads :func:`run_scan` uses when not told: one per core, at most :data:`MAX_WORKERS`."""
    return max(1, min(MAX_WORKERS, os.cpu_count() or 1))


@dataclass
class _Where:
    name: str | None
    file: Path
    key: tuple[Any, ...]
    kind: StoredKind
    dtype: str
    rank: int | None
    replica: int
    aliases: tuple[str, ...]
    padding_rows: tuple[int, int] | None = None


@dataclass(frozen=True, eq=False)
class _Part:
    """``numel`` elements from element ``src`` of ``ref``, into element ``dst`` of piece ``slot``'s
    chunk buffer; ``lo`` is the first element's logical (or stored, for raw scans) index."""

    slot: int
    where: _Where
    ref: Any
    src: int
    numel: int
    dst: int
    lo: int
    overflow: bool
    padding: bool = False  # stage-3 partition padding (RawScan.partition_padding): read, never reported
    # A fragment strided in the logical tensor (a TP row slice): the part is its elements [k0, k0 + numel), read
    # in one go from ``src``; element i lands at logical ``frag.dst_index(k0 + i)`` (``dst``/``lo``: the first's).
    frag: Fragment | None = None
    k0: int = 0

    def logical(self, i: int) -> int:
        """Logical (or stored) index of this part's ``i``-th element."""
        return self.lo + i if self.frag is None else self.frag.dst_index(self.k0 + i)


@dataclass(frozen=True, eq=False)
class _Task:
    """One chunk ``[base, base + numel)`` of one logical tensor: every stored copy of it."""

    dtypes: tuple[str, ...]  # per slot
    parts: tuple[_Part, ...]  # in tally order: slot by slot, fragment by fragment
    base: int
    numel: int
    compare: tuple[int, int] | None  # (master slot, 16-bit slot)
    compare_wheres: tuple[_Part, ...]  # 16-bit fragments' parts, for where their elements are
    numel_scanned: int


@dataclass(frozen=True)
class _Update:
    check: Check
    where: _Where
    numel: int
    count: int = 0
    nan: int = 0
    posinf: int = 0
    neginf: int = 0
    first: tuple[int, ...] = ()
    nbytes_read: int = 0


class _Tally:
    __slots__ = ("count", "first", "nan", "neginf", "numel", "posinf")

    def __init__(self) -> None:
        self.count = self.nan = self.posinf = self.neginf = self.numel = 0
        self.first: list[int] = []

    def add(self, u: _Update) -> None:
        self.numel += u.numel
        self.count += u.count
        self.nan += u.nan
        self.posinf += u.posinf
        self.neginf += u.neginf
        if len(self.first) < MAX_INDICES:
            self.first += u.first[: MAX_INDICES - len(self.first)]


class _Collector:
    def __init__(self) -> None:
        self.tallies: dict[tuple[Check, str | None, Path, tuple[Any, ...], int, tuple[int, int] | None],
                           tuple[_Where, _Tally]] = {}

    def get(self, check: Check, where: _Where) -> _Tally:
        k = (check, where.name, where.file, where.key, where.replica, where.padding_rows)
        if k not in self.tallies:
            self.tallies[k] = (where, _Tally())
        return self.tallies[k][1]

    def findings(self) -> list[Finding]:
        out = []
        for (check, *_), (w, t) in self.tallies.items():
            if t.count:
                out.append(Finding(check, w.name, w.file, w.key, w.kind, w.dtype, t.count, t.numel,
                                   tuple(t.first), t.nan, t.posinf, t.neginf, w.rank, w.replica, w.aliases,
                                   w.padding_rows))
        return out


def run_scan(plan: ScanPlan, cache: FileCache, *, on_progress: Callable[[int], None] | None = None,
             workers: int | None = None) -> ScanReport:
    """Read what ``plan`` names and report findings (the same, in the same order, whatever ``workers``).

    ``workers`` threads (default :func:`default_workers`; 0 = this thread only) each read and check
    whole chunks -- every stored copy of ``plan.chunk_numel`` elements of one tensor, CRC-32 included --
    into buffers of their own, so memory is bounded by ``workers`` sets of chunk buffers."""
    findings, stored, totals = _scan_pass(plan, cache, on_progress=on_progress, workers=workers)
    cache.finish_checks()  # CRC-32s of records read only partly (16-bit flat buffers' padding ...)
    return _report(plan, [*findings, *plan.scalars], len(stored), totals)


def _report(plan: ScanPlan, found: list[Finding], stored_tensors: int, totals: tuple[int, int]) -> ScanReport:
    return ScanReport(plan.target, plan.target_kind, plan.checks,
                      tuple(f for f in found if f.kind is not StoredKind.CLIENT_STATE), stored_tensors,
                      totals[0], totals[1],
                      client_state=tuple(f for f in found if f.kind is StoredKind.CLIENT_STATE))


def _scan_pass(plan: ScanPlan, cache: FileCache, *, on_progress: Callable[[int], None] | None,
               workers: int | None) -> tuple[list[Finding], set[tuple[Path, tuple[Any, ...]]], tuple[int, int]]:
    """The value pass of :func:`run_scan` (no CRC completion): findings in tally order, the stored
    tensors read, and (numel scanned, bytes read)."""
    col = _Collector()
    stored: set[tuple[Path, tuple[Any, ...]]] = set()
    totals = [0, 0]  # numel scanned, bytes read
    chunk = max(1, plan.chunk_numel)
    workers = default_workers() if workers is None else workers
    local = threading.local()
    opened: list[_OpenFiles] = []  # every thread's, closed at the end

    def work(task: _Task) -> list[_Update]:
        pool = getattr(local, "pool", None)
        if pool is None:
            pool = local.pool = {}
            local.files = _OpenFiles()
            opened.append(local.files)  # list.append is atomic
        return _run_task(task, chunk, pool, local.files)

    def apply(task: _Task, updates: list[_Update]) -> None:
        for u in updates:
            col.get(u.check, u.where).add(u)
            if u.nbytes_read:
                totals[1] += u.nbytes_read
                if on_progress is not None:
                    on_progress(u.nbytes_read)
        totals[0] += task.numel_scanned

    tasks = _tasks(plan, cache, chunk, stored)
    try:
        if workers <= 0:
            for task in tasks:
                apply(task, work(task))
        else:
            _run_pool(tasks, work, apply, workers)
    finally:
        for files in opened:
            files.close()
    return col.findings(), stored, (totals[0], totals[1])


def _run_pool(tasks: Iterator[_Task], work: Callable[[_Task], list[_Update]],
              apply: Callable[[_Task, list[_Update]], None], workers: int) -> None:
    """``work`` the tasks in ``workers`` threads and ``apply`` the results in task order, as
    ``for t in tasks: apply(t, work(t))`` would (an error raised for a task, or by ``tasks``, is raised
    once every earlier task is applied).

    The workers take the next task themselves (under a lock: ``tasks`` runs in one thread at a time)
    and whichever finishes the oldest pending task applies it and every finished one after it; at most
    ``4 * workers`` are taken ahead of the oldest. The calling thread only waits: it no longer competes
    with the workers for the GIL once per task (ZeRO-3 1B scan on the 16-core host, zlib's CRC:
    2.36 s vs 2.55 s with a producer/consumer calling thread; issue 12)."""
    claim, ordered = threading.Lock(), threading.Lock()
    room = threading.Semaphore(4 * workers)
    numbered = enumerate(tasks)
    finished: dict[int, tuple[_Task | None, list[_Update] | BaseException]] = {}
    state: dict[str, Any] = {"applied": 0, "error": None, "stop": False, "count": 0}

    def halt(error: BaseException) -> None:
        state["error"], state["stop"] = error, True
        room.release(workers)  # wake any worker waiting for room, to see the stop

    def finish(i: int, task: _Task | None, result: list[_Update] | BaseException) -> None:
        with ordered:
            finished[i] = (task, result)
            while state["error"] is None and state["applied"] in finished:
                t, r = finished.pop(state["applied"])
                if isinstance(r, BaseException):
                    halt(r)
                    break
                try:
                    assert t is not None
                    apply(t, r)
                except BaseException as e:  # noqa: BLE001 - raised in the calling thread below
                    halt(e)
                    break
                state["applied"] += 1
                room.release()

    def run() -> None:
        while True:
            room.acquire()
            with claim:
                if state["stop"]:
                    return
                try:
                    i, task = next(numbered)
                except StopIteration:
                    state["stop"] = True
                    return
                except BaseException as e:  # noqa: BLE001 - a corrupt checkpoint found while planning a task
                    state["stop"] = True
                    finish(state["count"], None, e)
                    return
                state["count"] = i + 1
            try:
                result: list[_Update] | BaseException = work(task)
            except BaseException as e:  # noqa: BLE001 - handed to the calling thread, in task order
                result = e
            finish(i, task, result)

    threads = [threading.Thread(target=run, name=f"dsckpt-scan-{k}", daemon=True) for k in range(workers)]
    try:
        for t in threads:
            t.start()
        for t in threads:
            while t.is_alive():
                t.join(0.2)  # a timed join keeps Ctrl-C and SIGTERM prompt
    finally:
        state["stop"] = True
        room.release(workers)
        for t in threads:
            t.join()
    if state["error"] is not None:
        raise state["error"]


def _tasks(plan: ScanPlan, cache: FileCache, chunk: int,
           stored: set[tuple[Path, tuple[Any, ...]]]) -> Iterator[_Task]:
    """The chunks to check, in plan order. Resolves every stored tensor here, in the calling thread."""
    for es in plan.entries:
        wheres: list[list[_Where]] = []
        refs: list[list[Any]] = []
        # Contiguous fragments sorted by destination, for bisection; fragments strided in the logical tensor (TP
        # row slices) apart: each becomes one part per chunk it meets, read in one go, not one per row.
        frags, striding = [], []
        for piece in es.pieces:
            fs, ss = reading_fragments(piece)
            frags.append(fs)
            striding.append(ss)
        starts = [[f.dst_offset for f in fs] for fs in frags]
        for piece, kind, fs, ss in zip(es.pieces, es.kinds, frags, striding):
            wheres.append([_Where(es.name, f.file, f.key, kind, piece.dtype, f.rank, piece.replica, es.aliases,
                                  es.padding_rows) for f in (*fs, *ss)])
            refs.append([cache.tensor(f.file, f.key) for f in (*fs, *ss)])
            for f in (*fs, *ss):
                stored.add((f.file, f.key))
            if piece.numel != es.numel:
                raise CorruptCheckpointError(
                    f"tensor '{es.name}': its {piece.role.value} copy has {piece.numel} elements in the files, "
                    f"its shape needs {es.numel}; the checkpoint metadata is inconsistent")
        dtypes = tuple(p.dtype for p in es.pieces)
        for a in range(0, es.numel, chunk):
            b = min(es.numel, a + chunk)
            slots = [_chunk_parts(pi, frags[pi], starts[pi], striding[pi], wheres[pi], refs[pi], a, b,
                                  pi in es.overflow_pieces) for pi in range(len(es.pieces))]
            compare = slots[es.compare[1]] if es.compare is not None else []
            yield _Task(dtypes, tuple(p for parts in slots for p in parts), a, b - a, es.compare, tuple(compare),
                        (b - a) * len(es.pieces))
    for r in plan.raw:
        stored.add((r.file, r.key))
        ref = _tree_ref(cache, r)
        kind = StoredKind.CLIENT_STATE if r.client_state else StoredKind.OTHER
        w = _Where(None, r.file, r.key, kind, r.dtype, None, 0, ())
        for a in range(0, r.numel, chunk):
            n = min(chunk, r.numel - a)
            yield _Task((r.dtype,), (_Part(0, w, ref, r.start + a, n, 0, r.start + a, False, r.partition_padding),),
                        r.start + a, n, None, (), n)


def _chunk_parts(slot: int, flat: list[Fragment], starts: list[int], striding: list[Fragment], wheres: list[_Where],
                 refs: list[Any], a: int, b: int, overflow: bool) -> list[_Part]:
    """The parts of one stored copy (``slot``) that chunk ``[a, b)`` reads: the contiguous fragments it meets
    (found by bisection), and for each fragment strided in the logical tensor the run of its elements landing in
    the chunk (consecutive in its source), in logical order of their first elements, so a finding lists its
    indices in increasing order."""
    parts = []
    for fi in range(max(0, bisect.bisect_right(starts, a) - 1), len(flat)):
        f = flat[fi]
        if f.dst_offset >= b:
            break
        lo, hi = max(a, f.dst_offset), min(b, f.dst_offset + f.numel)
        if lo < hi:
            parts.append(_Part(slot, wheres[fi], refs[fi], f.src_offset + lo - f.dst_offset, hi - lo, lo - a, lo,
                               overflow))
    for si, f in enumerate(striding, len(flat)):
        k0, k1 = f.window(a, b)
        if k0 < k1:
            lo = f.dst_index(k0)
            parts.append(_Part(slot, wheres[si], refs[si], f.src_offset + k0, k1 - k0, lo - a, lo, overflow,
                               frag=f, k0=k0))
    if striding:
        parts.sort(key=lambda p: p.lo)
    return parts


def _buffer(pool: dict[Any, np.ndarray], key: Any, dtype: Any, numel: int) -> np.ndarray:
    """``numel`` elements of ``dtype`` at the start of the reused byte buffer ``key`` of this thread's
    ``pool`` (grown when too small), for whatever dtype each use needs."""
    nbytes = numel * np.dtype(dtype).itemsize
    raw = pool.get(key)
    if raw is None or raw.nbytes < nbytes:
        raw = pool[key] = np.empty(nbytes, dtype=np.uint8)
    return raw[:nbytes].view(dtype)


class _OpenFiles:
    """The files one scan thread reads, each opened once (at most :data:`MAX_OPEN_FILES`): opening and
    closing a file for every 2 MiB read cost two more GIL round trips per read, which eight threads
    contend for (the 16-core host, issue 12)."""

    def __init__(self) -> None:
        self.fds: dict[Path, int] = {}

    def fd(self, path: Path) -> int:
        fd = self.fds.get(path)
        if fd is None:
            if len(self.fds) >= MAX_OPEN_FILES:
                os.close(self.fds.pop(next(iter(self.fds))))
            fd = self.fds[path] = os.open(path, os.O_RDONLY)
        return fd

    def close(self) -> None:
        while self.fds:
            os.close(self.fds.popitem()[1])


MAX_OPEN_FILES = 32  # per scan thread


def _run_task(task: _Task, chunk: int, pool: dict[Any, np.ndarray], files: _OpenFiles) -> list[_Update]:
    """Read and check one chunk (in a worker thread): the tally updates, in tally order.

    Each stored copy gets a buffer of its own only when the copies are compared with each other;
    otherwise every part goes through one buffer, in turn."""
    bufs = [_buffer(pool, slot, DTYPES[d].numpy, chunk)[: task.numel] for slot, d in enumerate(task.dtypes)
            ] if task.compare is not None else []
    out: list[_Update] = []
    for p in task.parts:
        dtype = task.dtypes[p.slot]
        if bufs and p.frag is None:
            part = bufs[p.slot][p.dst: p.dst + p.numel]
        else:
            part = _buffer(pool, "part", DTYPES[dtype].numpy, p.numel)
        _read_into(p.ref, p.src, p.numel, part, files)
        if bufs and p.frag is not None:
            place(part, bufs[p.slot], p.frag, p.k0, task.base)
        nan, posinf, neginf, first = _nonfinite(part, dtype, pool)
        if p.padding:
            if nan + posinf + neginf:
                logger.info("%s %s: non-finite leftover bytes in stage-3 partition padding (ignored)",
                            p.where.file.name, p.where.key)
            out.append(_Update(Check.NONFINITE, p.where, 0, nbytes_read=part.nbytes))
            continue
        out.append(_Update(Check.NONFINITE, p.where, p.numel, nan + posinf + neginf, nan, posinf, neginf,
                           tuple(p.logical(int(i)) for i in first), part.nbytes))
        if p.overflow:
            count, first = _fp16_overflow(part)
            out.append(_Update(Check.FP16_OVERFLOW, p.where, p.numel, count,
                               first=tuple(p.logical(int(i)) for i in first)))
    if task.compare is not None:
        mi, li = task.compare
        differ = _differ(bufs[mi], bufs[li], task.dtypes[li], pool, chunk)
        for p in task.compare_wheres:
            if differ is None:
                out.append(_Update(Check.MISMATCH, p.where, p.numel))
            elif p.frag is None:
                d = differ[p.dst: p.dst + p.numel]
                first = np.flatnonzero(d)[:MAX_INDICES]
                out.append(_Update(Check.MISMATCH, p.where, p.numel, int(np.count_nonzero(d)),
                                   first=tuple(int(i) + p.lo for i in first)))
            else:  # the part's elements, wherever they lie in the chunk, in order
                views = [(k, v.reshape(-1))
                         for k, v in fragment_views(differ, p.frag, p.k0, p.k0 + p.numel, task.base)]
                count = sum(int(np.count_nonzero(v)) for _, v in views)
                at = [p.frag.dst_index(k + int(i)) for k, v in views for i in np.flatnonzero(v)[:MAX_INDICES]]
                out.append(_Update(Check.MISMATCH, p.where, p.numel, count, first=tuple(at[:MAX_INDICES])))
    return out


def _read_into(ref: Any, start: int, numel: int, out: np.ndarray, files: _OpenFiles) -> None:
    if isinstance(ref, TensorRef):
        if not ref.is_contiguous():
            import torch  # strided stored tensors only (never written by DeepSpeed): torch gathers them

            got = ref.read(start, numel).contiguous()
            out.view(np.uint8)[:] = got.reshape(-1).view(torch.uint8).numpy()
            return
        ref.read_numpy(start, numel, out=out, fd=files.fd(ref.storage.path))
    else:  # a SafetensorsRef
        path = getattr(ref, "path", None)
        ref.read_numpy(start, numel, out=out, fd=None if path is None else files.fd(path))


# The exponent bits of each IEEE type: a value is inf/NaN exactly when all of them are set.
_EXPONENT = {"bfloat16": ("<u2", 0x7F80), "float16": ("<u2", 0x7C00), "float32": ("<u4", 0x7F800000)}


def _nonfinite(x: np.ndarray, dtype: str, pool: dict[Any, np.ndarray]) -> tuple[int, int, int, np.ndarray]:
    """``(nan, +inf, -inf, first indices)`` of a chunk of stored ``dtype`` bytes (see :mod:`dsckpt.dtypes`).

    Proving a chunk finite costs one AND and one max over its exponent bits (no float conversion,
    no mask); only a chunk that holds inf/NaN is counted exactly."""
    none = np.empty(0, dtype=np.intp)
    exp = _EXPONENT.get(dtype)
    if exp is not None:
        view, mask = exp
        bits = x.view(view)
        tmp = _buffer(pool, "exponent", view, len(bits))
        np.bitwise_and(bits, mask, out=tmp)
        if int(tmp.max()) != mask:
            return 0, 0, 0, none
        f = to_float32(x, dtype)
    elif x.dtype.kind in "fc":
        with np.errstate(all="ignore"):
            if np.isfinite(np.sum(x)):
                return 0, 0, 0, none
        f = x
    else:
        return 0, 0, 0, none
    bad = ~np.isfinite(f)
    vals = f[bad]
    if vals.dtype.kind == "c":
        nan = int(np.count_nonzero(np.isnan(vals)))
        posinf = int(np.count_nonzero((vals.real == np.inf) | (vals.imag == np.inf)))
        neginf = len(vals) - nan - posinf
    else:
        nan = int(np.count_nonzero(np.isnan(vals)))
        posinf = int(np.count_nonzero(vals == np.inf))
        neginf = int(np.count_nonzero(vals == -np.inf))
    return nan, posinf, neginf, np.flatnonzero(bad)[:MAX_INDICES]


def _fp16_overflow(x: np.ndarray) -> tuple[int, np.ndarray]:
    """Finite float32 values with ``|x| > FP16_MAX``: count and first indices."""
    with np.errstate(invalid="ignore"):
        if x.max() <= FP16_MAX and x.min() >= -FP16_MAX:  # a NaN fails both: counted below
            return 0, np.empty(0, dtype=np.intp)
        over = np.isfinite(x) & (np.abs(x) > FP16_MAX)
    return int(np.count_nonzero(over)), np.flatnonzero(over)[:MAX_INDICES]


def _differ(master: np.ndarray, lowp: np.ndarray, lowp_dtype: str, pool: dict[Any, np.ndarray],
            chunk: int) -> np.ndarray | None:
    """Where the stored 16-bit values differ from the fp32 master rounded to ``lowp_dtype`` (all three
    finite), or None when the chunk is proven equal bit for bit (the common case: no mask is built)."""
    n = len(master)
    rounded = _buffer(pool, "rounded", "<u2", chunk)[:n]
    if lowp_dtype == "bfloat16":
        # from_float32's round to nearest even, in place in a reused buffer; NaN masters may come out
        # wrong here, which only sends the chunk to the exact comparison below.
        u = master.view(np.uint32)
        t = _buffer(pool, "round", "<u4", chunk)[:n]
        np.right_shift(u, 16, out=t)
        np.bitwise_and(t, 1, out=t)
        np.add(t, 0x7FFF, out=t)
        np.add(t, u, out=t)
        np.right_shift(t, 16, out=t)
        np.copyto(rounded, t, casting="unsafe")
    else:
        with np.errstate(over="ignore"):
            np.copyto(rounded.view(np.float16), master, casting="unsafe")
    if np.array_equal(rounded, lowp.view(np.uint16)):
        return None
    r = to_float32(from_float32(master, lowp_dtype), lowp_dtype)
    lo = to_float32(lowp, lowp_dtype)
    with np.errstate(invalid="ignore"):
        return np.isfinite(master) & np.isfinite(r) & np.isfinite(lo) & (r != lo)


def _tree_ref(cache: FileCache, r: RawScan) -> TensorRef:
    obj = lookup(cache.tree(r.file), r.key, r.file)
    assert isinstance(obj, TensorRef), "plan_scan only plans raw scans of tensors"
    return obj


# --------------------------------------------------------------------------------------------
# Front door


def open_target(target: str | os.PathLike[str], *, tag: str | None = None
                ) -> tuple[LogicalCheckpoint, FileCache, TargetKind]:
    """Open anything ``scan`` accepts: a DeepSpeed checkpoint, a ``.safetensors`` file, a sharded
    safetensors folder, or a torch state-dict file."""
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
    logical, cache, kind = open_target(target, tag=tag)
    is_st = getattr(cache, "is_safetensors", lambda _f: False)
    trees = {f: cache.tree(f) for f in logical.files if not is_st(f)}
    plan = plan_scan(logical, trees, cache.tensor, target=Path(target), target_kind=kind,
                     nonfinite_only=nonfinite_only, chunk_numel=chunk_numel)
    return plan, cache


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
            "entries": [[e.name, e.numel, [[p.role.value if p.role else None, p.dtype, p.numel] for p in e.pieces]]
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

    def share() -> tuple[list[tuple[int, Finding]], set[tuple[Path, tuple[Any, ...]]], tuple[int, int], Any]:
        sub = dataclasses.replace(
            plan, entries=tuple(plan.entries[e] for i in mine for e in items[i].entries),
            raw=tuple(plan.raw[k] for k in sorted(k for i in mine for k in items[i].raw)), scalars=())
        found, stored, totals = _scan_pass(sub, cache, on_progress=on_progress, workers=workers)
        return [(item_of(f), f) for f in found], stored, totals, export_segments(checks)

    shares = group.step(share, "the scan")
    group.step(lambda: crc.finish(owned_checks(checks, [s[3] for s in shares], group)), "the CRC-32 checks")
    ordered = sorted((pair for s in shares for pair in s[0]), key=lambda pair: pair[0])
    stored_all: set[tuple[Path, tuple[Any, ...]]] = set().union(*(s[1] for s in shares))
    totals = (sum(s[2][0] for s in shares), sum(s[2][1] for s in shares))
    return _report(plan, [*(f for _, f in ordered), *plan.scalars], len(stored_all), totals)


def _item_of(items: tuple[ScanItem, ...], plan: ScanPlan) -> Callable[[Finding], int]:
    name_to_item = {plan.entries[it.entries[0]].name: i for i, it in enumerate(items) if it.entries}
    stored_to_item = {(plan.raw[it.raw[0]].file, plan.raw[it.raw[0]].key): i for i, it in enumerate(items) if it.raw}
    return lambda f: name_to_item[f.name] if f.name is not None else stored_to_item[(f.file, f.key)]
