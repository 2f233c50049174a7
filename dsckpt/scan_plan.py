"""What ``scan`` reads and reports, decided without reading values: the finding and plan records and
:func:`plan_scan` (pure: parsed file metadata in, frozen plan out). :mod:`dsckpt.scan_engine` reads the plan's
chunks; :mod:`dsckpt.scan` is the front door and documents what is read and checked."""

from __future__ import annotations

import dataclasses
import enum
import heapq
import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from . import parsed_tree, stand_ins
from .dtypes import dtype_info
from .layout import Owner, key_owner
from .model import (
    Kind,
    LogicalCheckpoint,
    Piece,
    Precision,
    Role,
    TensorEntry,
)
from .readers.common import format_key
from .state_dict_files import TargetKind
from .tensor_ref import TensorRef

if TYPE_CHECKING:
    import torch

    from .training_state import TrainingState

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "FP16_MAX",
    "MAX_INDICES",
    "NONFINITE_CHUNK_NUMEL",
    "Check",
    "EntryScan",
    "Finding",
    "HealthCheck",
    "HealthFinding",
    "RawScan",
    "ScanPlan",
    "ScanReport",
    "StoredKind",
    "count_nonfinite",
    "nonfinite_scalars",
    "plan_scan",
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


class HealthCheck(enum.Enum):
    """Findings about the training state rather than about values of one stored tensor (issue 39)."""

    LOSS_SCALE = "loss_scale"  # an fp16 run's dynamic loss scale sits at its floor
    STATE_RESET = "state_reset"  # a trained param's optimizer state is all zeros where its neighbours' are not


@dataclass(frozen=True)
class HealthFinding:
    check: HealthCheck
    name: str | None  # the param, for state_reset
    message: str

    def describe(self) -> str:
        return self.message

    def to_dict(self) -> dict[str, Any]:
        return {"check": self.check.value, "name": self.name, "message": self.message}


class StoredKind(enum.Enum):
    """What a stored copy is, as reported to users."""

    PARAM = "param"
    BUFFER = "buffer"
    FROZEN = "frozen"
    MASTER = "fp32 master"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    OPTIM_STATE = "optimizer state"  # any other per-element optimizer state (momentum_buffer, sum, ...)
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


def stored_kind(entry: TensorEntry | None, role: Role | None, state_key: str | None = None) -> StoredKind:
    if entry is None or role is None:
        return StoredKind.OTHER
    if role is Role.MASTER:
        return StoredKind.MASTER
    if role is Role.OPTIM_STATE:
        return {"exp_avg": StoredKind.EXP_AVG, "exp_avg_sq": StoredKind.EXP_AVG_SQ}.get(state_key or "",
                                                                                      StoredKind.OPTIM_STATE)
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
    training: TrainingState | None = None  # a DeepSpeed checkpoint's loss scaler and skipped steps

    @property
    def checks_run(self) -> tuple[Check, ...]:
        """The checks of :attr:`checks` that apply to something in the plan: ``fp16_overflow`` only where an fp32
        master of an fp16 run is read, ``mismatch`` only where a master has a 16-bit copy to compare with (never
        in a plain safetensors or fp32 checkpoint); ``nonfinite`` always."""
        applies = {Check.NONFINITE: True,
                   Check.FP16_OVERFLOW: any(e.overflow_pieces for e in self.entries),
                   Check.MISMATCH: any(e.compare is not None for e in self.entries)}
        return tuple(c for c in self.checks if applies[c])


@dataclass(frozen=True)
class ScanReport:
    target: Path
    target_kind: TargetKind
    checks: tuple[Check, ...]  # the checks that ran (ScanPlan.checks_run)
    findings: tuple[Finding, ...]
    stored_tensors: int
    numel_scanned: int
    nbytes_read: int
    notes: tuple[str, ...] = field(default_factory=tuple)
    # non-finite values in client state (kind CLIENT_STATE): shown apart, never findings
    client_state: tuple[Finding, ...] = field(default_factory=tuple)
    training: TrainingState | None = None
    # findings about the training state: a loss scale at its floor, an optimizer state silently reset
    health: tuple[HealthFinding, ...] = field(default_factory=tuple)

    @property
    def clean(self) -> bool:
        return not self.findings and not self.health

    def of(self, check: Check) -> list[Finding]:
        return [f for f in self.findings if f.check is check]

    def to_dict(self) -> dict[str, Any]:
        return {
            "target": str(self.target), "target_kind": self.target_kind.value,
            "checks": [c.value for c in self.checks], "clean": self.clean,
            "stored_tensors": self.stored_tensors, "numel_scanned": self.numel_scanned,
            "nbytes_read": self.nbytes_read, "findings": [f.to_dict() for f in self.findings],
            "notes": list(self.notes), "client_state_nonfinite": [f.to_dict() for f in self.client_state],
            "training": None if self.training is None else self.training.to_dict(),
            "health": [h.to_dict() for h in self.health],
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
            kinds = tuple(stored_kind(e, p.role, p.state_key) for p in pieces)
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
    where the HF Trainer writes ``steps_per_print: inf``) is skipped. A container or float the pickle shares
    between several places of one file is visited once and reported under the first path that reaches it. Pure."""
    out: list[Finding] = []
    seen: set[int] = set()  # of the file being visited

    def visit(x: Any, path: Path, key: tuple[Any, ...]) -> None:
        if isinstance(x, (float, dict, list, tuple, stand_ins.DeepSpeedObject)):
            if id(x) in seen:  # the memo first: constant work for each further reference
                return
            seen.add(id(x))
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
        elif isinstance(x, stand_ins.DeepSpeedObject):
            for k, v in x.__dict__.items():
                visit(v, path, (*key, k))

    for path, tree in trees.items():
        seen.clear()
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
        for order, (key, ref) in enumerate(parsed_tree.walk_tensors(tree)):
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


