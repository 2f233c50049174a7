"""``diff``: compare two checkpoints tensor by tensor, by name, in bounded memory.

Each side is anything :func:`dsckpt.scan.open_target` opens: a DeepSpeed checkpoint, a
``.safetensors`` file, a folder of safetensors shards, or a torch state-dict file (safe loader).

:func:`plan_diff` pairs the names of two logical checkpoints (only in A, only in B, shape mismatch,
no such copy, to compare) without reading tensor data; :func:`run_diff` streams every pair chunk by
chunk, both sides cut at the same element boundaries, so memory stays at a few chunks whatever the
tensor size.

What is compared (``role``):

* ``value`` (default): what ``to-fp32`` exports, in its stored dtype: the fp32 master where there is
  one, else the stored (module) copy. A consolidated state dict has one copy per tensor: that one.
* ``master`` / ``module`` / ``exp_avg`` / ``exp_avg_sq``: that copy of a DeepSpeed checkpoint
  (before/after ``repair``, which patches the module copy and the master). A state-dict side offers
  its one copy for whichever role is asked. A name whose DeepSpeed side has no such copy (buffers
  have no master, ZeRO-3 params no module copy) is ``skipped``, which is not a difference.
* ``all``: every role both DeepSpeed checkpoints hold for a name (both sides must be DeepSpeed).

Only the primary copy is read (replica 0): stage-3 buffer replicas on other ranks are ``scan``'s job.

Per pair: bitwise equality (same dtype and same bytes); then, by value, in float64 (bf16/fp16 widen
exactly): an element is *equal* when ``a == b`` (so ``-0.0 == 0.0`` and ``inf == inf``) or both are
NaN. The number of differing elements, the max absolute difference ``|a - b|`` and the max relative
difference ``|a - b| / |b|`` are over the differing elements; a difference involving NaN or inf (and
a relative one where ``b == 0``) is ``inf``. An element is *within tolerance* when equal, or when both
are finite and ``|a - b| <= atol + rtol * |b|`` (numpy's ``allclose`` rule, B the reference). Integer
and bool tensors (both sides) compare exactly: tolerance does not apply.

A pair is ``equal`` (bitwise), ``close`` (every element within tolerance, but not bitwise equal: another
dtype holding the same values, ``-0.0`` vs ``0.0``, or differences within tolerance) or ``different``.
A dtype difference alone does not make a pair different unless ``strict_dtype``. Two checkpoints are
equal when no pair is different and no name is only on one side or differs in shape.
"""

from __future__ import annotations

import bisect
import dataclasses
import enum
import math
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from .chunks import check_numel, place, tiling_problem
from .dtypes import DTYPES, dtype_info, to_float32
from .errors import CorruptCheckpointError, UsageError
from .model import Fragment, Kind, LogicalCheckpoint, Piece, Role, TensorEntry, reading_fragments
from .readers.common import FileCache
from .state_dict_files import TargetKind
from .tensor_ref import TensorRef

__all__ = [
    "DEFAULT_CHUNK_NUMEL",
    "MAX_INDICES",
    "TOLERANCE_RULE",
    "DiffInput",
    "DiffPlan",
    "DiffReport",
    "DiffRole",
    "PairPlan",
    "Status",
    "TensorDiff",
    "diff",
    "open_input",
    "plan_diff",
    "prepare_diff",
    "run_diff",
    "run_diff_distributed",
]

DEFAULT_CHUNK_NUMEL = 1 << 20  # 1M elements per side: a few tens of MB with the float64 working copies
MAX_INDICES = 8
TOLERANCE_RULE = "|a - b| <= atol + rtol * |b|"


class DiffRole(enum.Enum):
    """Which stored copy of each name is compared."""

    VALUE = "value"  # what to-fp32 exports: fp32 master, else the stored copy
    MASTER = "master"
    MODULE = "module"
    EXP_AVG = "exp_avg"
    EXP_AVG_SQ = "exp_avg_sq"
    ALL = "all"


class Status(enum.Enum):
    EQUAL = "equal"  # same dtype, same bytes
    CLOSE = "close"  # every element within tolerance, not bitwise equal
    DIFFERENT = "different"
    ONLY_IN_A = "only_in_a"
    ONLY_IN_B = "only_in_b"
    SHAPE_MISMATCH = "shape_mismatch"
    SKIPPED = "skipped"  # the requested copy does not exist on one side (not a difference)


_FAILING = (Status.DIFFERENT, Status.ONLY_IN_A, Status.ONLY_IN_B, Status.SHAPE_MISMATCH)
_ROLE_ORDER = (Role.MASTER, Role.MODULE)  # then the optimizer states, in the optimizer's order


@dataclass(frozen=True)
class DiffInput:
    """One side of a diff: where it is, what kind of target, its logical checkpoint."""

    path: Path
    kind: TargetKind
    logical: LogicalCheckpoint

    @property
    def is_deepspeed(self) -> bool:
        return self.kind is TargetKind.DEEPSPEED

    def describe(self) -> str:
        tag = f", tag {self.logical.tag}" if self.is_deepspeed else ""
        return f"{self.path} ({self.kind.value}{tag})"

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "kind": self.kind.value,
                "tag": self.logical.tag if self.is_deepspeed else None}


@dataclass(frozen=True)
class PairPlan:
    """Read ``piece_a`` and ``piece_b`` (both ``numel`` elements, same shape) and compare them."""

    name: str
    role: str  # "value" or a Role value
    shape: tuple[int, ...]
    piece_a: Piece
    piece_b: Piece
    copy_a: str  # which copy was chosen: "master", "module", ... or "stored" for a state dict
    copy_b: str

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * (dtype_info(self.piece_a.dtype).itemsize + dtype_info(self.piece_b.dtype).itemsize)


@dataclass(frozen=True)
class TensorDiff:
    """The comparison of one name (and role). Value fields are zero/None when nothing was read.

    ``first_indices``: flat indices of the first differing elements (by value); ``max_abs_index``:
    where the largest absolute difference is, with both values there (``a_at_max``, ``b_at_max``).
    """

    name: str
    role: str
    status: Status
    shape_a: tuple[int, ...] | None = None
    shape_b: tuple[int, ...] | None = None
    dtype_a: str | None = None
    dtype_b: str | None = None
    copy_a: str | None = None
    copy_b: str | None = None
    numel: int = 0
    bitwise_equal: bool = False
    n_differ: int = 0
    n_outside_tolerance: int = 0
    max_abs_diff: float = 0.0
    max_rel_diff: float = 0.0
    max_abs_index: int | None = None
    a_at_max: float | None = None
    b_at_max: float | None = None
    first_indices: tuple[int, ...] = ()
    exact: bool = False  # integer/bool on both sides: tolerance did not apply
    reason: str = ""

    @property
    def dtype_differs(self) -> bool:
        return self.dtype_a is not None and self.dtype_b is not None and self.dtype_a != self.dtype_b

    def describe(self) -> str:
        """One line for humans (without the status, which the caller prints)."""
        if self.status is Status.ONLY_IN_A or self.status is Status.ONLY_IN_B:
            side = self.shape_a if self.status is Status.ONLY_IN_A else self.shape_b
            dtype = self.dtype_a if self.status is Status.ONLY_IN_A else self.dtype_b
            return f"{self.name}: {list(side or ())} {dtype}"
        if self.status is Status.SHAPE_MISMATCH:
            return f"{self.name}{self._role_label()}: A {list(self.shape_a or ())} {self.dtype_a}, " \
                   f"B {list(self.shape_b or ())} {self.dtype_b}"
        if self.status is Status.SKIPPED:
            return f"{self.name}{self._role_label()}: {self.reason}"
        dtypes = f"{self.dtype_a} vs {self.dtype_b}" if self.dtype_differs else f"{self.dtype_a}"
        parts = [f"{self.name}{self._role_label()}: {dtypes}"]
        if self.reason:
            parts.append(self.reason)
        if self.n_differ == 0:
            parts.append("bitwise equal" if self.bitwise_equal else "all values equal")
        else:
            outside = "" if self.exact else f" ({self.n_outside_tolerance:,} outside tolerance)"
            parts.append(f"{self.n_differ:,} of {self.numel:,} values differ{outside}")
            parts.append(f"max abs diff {_fmt(self.max_abs_diff)} at index {self.max_abs_index} "
                         f"(A {_fmt(self.a_at_max)}, B {_fmt(self.b_at_max)})")
            parts.append(f"max rel diff {_fmt(self.max_rel_diff)}")
            parts.append(f"first indices {list(self.first_indices)}")
        return "; ".join(parts)

    def _role_label(self) -> str:
        if self.role != DiffRole.VALUE.value:
            return f" [{self.role}]"
        if self.copy_a and self.copy_b and self.copy_a != self.copy_b and "stored" not in (self.copy_a, self.copy_b):
            return f" [A {self.copy_a}, B {self.copy_b}]"
        return ""

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name, "role": self.role, "status": self.status.value,
            "shape_a": _list(self.shape_a), "shape_b": _list(self.shape_b),
            "dtype_a": self.dtype_a, "dtype_b": self.dtype_b, "copy_a": self.copy_a, "copy_b": self.copy_b,
            "numel": self.numel, "bitwise_equal": self.bitwise_equal, "n_differ": self.n_differ,
            "n_outside_tolerance": self.n_outside_tolerance, "max_abs_diff": _json_float(self.max_abs_diff),
            "max_rel_diff": _json_float(self.max_rel_diff), "max_abs_index": self.max_abs_index,
            "a_at_max": _json_float(self.a_at_max), "b_at_max": _json_float(self.b_at_max),
            "first_indices": list(self.first_indices), "exact": self.exact, "reason": self.reason,
        }


def _list(shape: tuple[int, ...] | None) -> list[int] | None:
    return None if shape is None else list(shape)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _json_float(x: float | None) -> float | str | None:
    """JSON has no inf/NaN: those become the strings ``"inf"``, ``"-inf"``, ``"nan"``."""
    if x is None or math.isfinite(x):
        return x
    return "nan" if math.isnan(x) else ("inf" if x > 0 else "-inf")


@dataclass(frozen=True)
class DiffPlan:
    a: DiffInput
    b: DiffInput
    role: DiffRole
    atol: float
    rtol: float
    strict_dtype: bool
    pairs: tuple[PairPlan, ...]
    decided: tuple[TensorDiff, ...]  # only in A / only in B / shape mismatch / skipped: nothing to read
    excluded: tuple[str, ...] = ()  # frozen params left out (exclude_frozen)
    order: tuple[tuple[str, str], ...] = ()  # (name, role) of every record, in report order
    chunk_numel: int = DEFAULT_CHUNK_NUMEL

    @property
    def nbytes(self) -> int:
        return sum(p.nbytes for p in self.pairs)


@dataclass(frozen=True)
class DiffReport:
    a: DiffInput
    b: DiffInput
    role: DiffRole
    atol: float
    rtol: float
    strict_dtype: bool
    tensors: tuple[TensorDiff, ...]
    excluded: tuple[str, ...] = field(default_factory=tuple)
    nbytes_read: int = 0

    def of(self, *statuses: Status) -> list[TensorDiff]:
        return [t for t in self.tensors if t.status in statuses]

    @property
    def equal(self) -> bool:
        """Equal within tolerance: nothing different, no name on one side only, no shape mismatch."""
        return not self.of(*_FAILING)

    def counts(self) -> dict[str, int]:
        compared = self.of(Status.EQUAL, Status.CLOSE, Status.DIFFERENT)
        return {
            "compared": len(compared),
            "equal_bitwise": len(self.of(Status.EQUAL)),
            "within_tolerance": len(self.of(Status.CLOSE)),
            "different": len(self.of(Status.DIFFERENT)),
            "only_in_a": len(self.of(Status.ONLY_IN_A)),
            "only_in_b": len(self.of(Status.ONLY_IN_B)),
            "shape_mismatch": len(self.of(Status.SHAPE_MISMATCH)),
            "skipped": len(self.of(Status.SKIPPED)),
            "dtype_differs": sum(1 for t in compared if t.dtype_differs),
            "excluded_frozen": len(self.excluded),
        }

    def summary(self) -> str:
        c = self.counts()
        line = (f"{c['compared']} tensors compared, {c['equal_bitwise']} equal bitwise, {c['within_tolerance']} "
                f"within tolerance, {c['different']} different, only in A: {c['only_in_a']}, only in B: "
                f"{c['only_in_b']}, shape mismatch: {c['shape_mismatch']}")
        if c["skipped"]:
            line += f", skipped (no such copy): {c['skipped']}"
        if c["excluded_frozen"]:
            line += f", excluded frozen: {c['excluded_frozen']}"
        return line

    def to_dict(self) -> dict[str, Any]:
        return {
            "a": self.a.to_dict(), "b": self.b.to_dict(), "role": self.role.value, "atol": self.atol,
            "rtol": self.rtol, "tolerance_rule": TOLERANCE_RULE, "strict_dtype": self.strict_dtype,
            "equal": self.equal, "counts": self.counts(), "nbytes_read": self.nbytes_read,
            "excluded": list(self.excluded), "tensors": [t.to_dict() for t in self.tensors],
        }


# --------------------------------------------------------------------------------------------
# Planning


def _copy_label(side: DiffInput, piece: Piece) -> str:
    return piece.label if side.is_deepspeed else "stored"


def _pick(side: DiffInput, entry: TensorEntry, copy: str | None) -> Piece | None:
    """The copy of ``entry`` to compare: ``copy`` None means what to-fp32 exports, else "master", "module" or an
    optimizer state key ("exp_avg", ...). A state dict has one copy per tensor, which stands for any role. A DCP
    folder holds the optimizer state too: its model tensor of a trained param is the master, and its state tensors
    are the optimizer's."""
    if copy is None or side.kind not in (TargetKind.DEEPSPEED, TargetKind.DCP):
        return entry.source_for_fp32()
    if side.kind is TargetKind.DCP and copy == Role.MASTER.value:
        return entry.source_for_fp32() if entry.trainable else None
    if copy in (Role.MASTER.value, Role.MODULE.value):
        return entry.piece(Role(copy))
    return entry.state_piece(copy)


def _named_like(side: DiffInput, other: DiffInput) -> DiffInput:
    """An AutoEP checkpoint under the Hugging Face model's names (:func:`dsckpt.autoep.hf_model_view`) when the other
    side is a state dict that uses them (what ``to-fp32 OUT/`` and ``to-dcp`` write); ``side`` itself otherwise."""
    if not side.is_deepspeed or other.is_deepspeed or side.logical.autoep is None:
        return side
    from .autoep import hf_model_view
    from .errors import UnsupportedCheckpointError

    try:
        hf = hf_model_view(side.logical)
    except UnsupportedCheckpointError:
        return side
    own, theirs = {e.name for e in side.logical.entries}, {e.name for e in other.logical.entries}
    return dataclasses.replace(side, logical=hf) if any(e.name not in own and e.name in theirs
                                                        for e in hf.entries) else side


def _is_frozen(e: TensorEntry | None) -> bool:
    return e is not None and e.kind is Kind.PARAM and e.trainable is False


def plan_diff(a: DiffInput, b: DiffInput, *, role: DiffRole | str = DiffRole.VALUE, atol: float = 0.0,
              rtol: float = 0.0, strict_dtype: bool = False, exclude_frozen: bool = False,
              chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> DiffPlan:
    """Pair the names of ``a`` and ``b`` and decide what to read. Pure: reads no tensor data.

    ``exclude_frozen`` leaves out every name that is a frozen param on either side (only DeepSpeed
    checkpoints know which params were frozen).
    """
    role = DiffRole(role)
    if not (atol >= 0 and rtol >= 0 and math.isfinite(atol) and math.isfinite(rtol)):
        raise UsageError(f"tolerances must be finite and >= 0, got atol={atol} rtol={rtol}")
    if chunk_numel < 1:
        raise UsageError(f"chunk_numel must be positive, got {chunk_numel}")
    if role is DiffRole.ALL and not (a.is_deepspeed and b.is_deepspeed):
        other = a if not a.is_deepspeed else b
        raise UsageError(f"--role all compares the stored copies of two DeepSpeed checkpoints; '{other.path}' is "
                         f"a {other.kind.value} state dict with one copy per tensor: use --role value, master or "
                         "module")
    for side in (a, b):
        if side.is_deepspeed:
            # Which stored tensor belongs to which name must be proven for what is compared (stage 0).
            side.logical.require_unambiguous(
                f"diff --role {role.value}", values=role is DiffRole.VALUE, flags=exclude_frozen,
                moments=role in (DiffRole.MASTER, DiffRole.EXP_AVG, DiffRole.EXP_AVG_SQ, DiffRole.ALL))
    a, b = _named_like(a, b), _named_like(b, a)
    a_by_name = {e.name: e for e in a.logical.entries}
    b_by_name = {e.name: e for e in b.logical.entries}
    names = list(a_by_name) + [n for n in b_by_name if n not in a_by_name]
    excluded = tuple(n for n in names if exclude_frozen and (_is_frozen(a_by_name.get(n))
                                                            or _is_frozen(b_by_name.get(n))))
    pairs: list[PairPlan] = []
    decided: list[TensorDiff] = []
    order: list[tuple[str, str]] = []
    problems: list[str] = []
    for name in names:
        if name in excluded:
            continue
        ea, eb = a_by_name.get(name), b_by_name.get(name)
        if ea is None or eb is None:
            if ea is not None:
                decided.append(TensorDiff(name, role.value, Status.ONLY_IN_A, shape_a=ea.shape,
                                          dtype_a=ea.source_for_fp32().dtype))
            elif eb is not None:
                decided.append(TensorDiff(name, role.value, Status.ONLY_IN_B, shape_b=eb.shape,
                                          dtype_b=eb.source_for_fp32().dtype))
            order.append((name, role.value))
            continue
        if ea.shape != eb.shape:
            decided.append(TensorDiff(name, role.value, Status.SHAPE_MISMATCH, ea.shape, eb.shape,
                                      ea.source_for_fp32().dtype, eb.source_for_fp32().dtype))
            order.append((name, role.value))
            continue
        if role is DiffRole.ALL:
            have_a = {p.label for p in ea.pieces}
            have_b = {p.label for p in eb.pieces}
            wanted: list[str | None] = [c for c in (*(r.value for r in _ROLE_ORDER), *ea.state_keys)
                                        if c in have_a and c in have_b]
        else:
            wanted = [None if role is DiffRole.VALUE else role.value]
        for r in wanted:
            label = role.value if r is None else r
            order.append((name, label))
            pa, pb = _pick(a, ea, r), _pick(b, eb, r)
            if pa is None or pb is None:
                missing = " and ".join(s for s, p in (("A", pa), ("B", pb)) if p is None)
                decided.append(TensorDiff(name, label, Status.SKIPPED, ea.shape, eb.shape,
                                          pa.dtype if pa else None, pb.dtype if pb else None,
                                          reason=f"no {label} copy in {missing}"))
                continue
            for which, e, p in (("A", ea, pa), ("B", eb, pb)):
                problem = _tiling_problem(e, p)
                if problem:
                    problems.append(f"{which} {problem}")
            pairs.append(PairPlan(name, label, ea.shape, pa, pb, _copy_label(a, pa), _copy_label(b, pb)))
        if not wanted:
            order.append((name, role.value))
            decided.append(TensorDiff(name, role.value, Status.SKIPPED, ea.shape, eb.shape,
                                      reason="no stored copy role in common"))
    if problems:
        more = f" (and {len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CorruptCheckpointError("; ".join(problems[:3]) + more + "; the checkpoint metadata is inconsistent")
    return DiffPlan(a, b, role, float(atol), float(rtol), strict_dtype, tuple(pairs), tuple(decided),
                    excluded, tuple(order), chunk_numel)


def _tiling_problem(entry: TensorEntry, piece: Piece) -> str | None:
    """Why ``piece``'s fragments do not cover the tensor exactly once, in order, or None."""
    try:
        numel = check_numel(piece, entry.shape, entry.name)
    except CorruptCheckpointError as e:
        return str(e)
    if any(f.strided for f in piece.fragments):  # TP row slices: rectangles compared, not one run per row
        why = tiling_problem(piece.fragments, numel)
        return None if why is None else (f"tensor '{entry.name}': the fragments of its {piece.label} copy do not "
                                         f"tile its {numel} elements ({why})")
    expected = 0
    for f in sorted(piece.fragments, key=lambda f: f.dst_offset):
        if f.dst_offset != expected or f.numel < 0 or f.src_offset < 0:
            return (f"tensor '{entry.name}': the fragments of its {piece.label} copy leave a gap or overlap "
                    f"at element {expected}")
        expected += f.numel
    return None if expected == numel else f"tensor '{entry.name}': fragments end at {expected}, not {numel}"


# --------------------------------------------------------------------------------------------
# Running


class _PieceReader:
    """Reads element windows ``[lo, hi)`` of one piece (in logical order) into reused buffers. A fragment strided
    in the logical tensor (a TP row slice) is read a window at a time in one go and placed with one strided copy."""

    def __init__(self, piece: Piece, cache: FileCache, name: str, pool: dict[tuple[int, str], np.ndarray],
                 slot: int, chunk_numel: int) -> None:
        self.piece = piece
        self.frags, self.striding = reading_fragments(piece)
        self.starts = [f.dst_offset for f in self.frags]
        self.cache = cache
        self.name = name
        self.buf = self._pooled(pool, (slot, piece.dtype), chunk_numel)
        self.tmp = self._pooled(pool, (slot, piece.dtype + " runs"), chunk_numel) if self.striding else self.buf

    def _pooled(self, pool: dict[tuple[int, str], np.ndarray], key: tuple[int, str], numel: int) -> np.ndarray:
        if key not in pool:
            pool[key] = np.empty(numel, dtype=DTYPES[self.piece.dtype].numpy)
        return pool[key]

    def read(self, lo: int, hi: int) -> np.ndarray:
        out = self.buf[: hi - lo]
        i = max(0, bisect.bisect_right(self.starts, lo) - 1)
        while i < len(self.frags) and self.frags[i].dst_offset < hi:
            f = self.frags[i]
            s, e = max(lo, f.dst_offset), min(hi, f.dst_offset + f.numel)
            if s < e:
                _read_into(self._ref(f), f.src_offset + s - f.dst_offset, out[s - lo: e - lo], self.piece.dtype)
            i += 1
        for f in self.striding:
            k0, k1 = f.window(lo, hi)
            if k0 < k1:
                _read_into(self._ref(f), f.src_offset + k0, self.tmp[: k1 - k0], self.piece.dtype)
                place(self.tmp[: k1 - k0], out, f, k0, lo)
        return out

    def _ref(self, f: Fragment) -> Any:
        ref = self.cache.tensor(f.file, f.key)
        have = ref.dtype_name if isinstance(ref, TensorRef) else str(ref.dtype).removeprefix("torch.")
        if have != self.piece.dtype:
            raise CorruptCheckpointError(f"{f.file}: tensor '{self.name}' is stored as {have}, its "
                                         f"{self.piece.label} copy is recorded as {self.piece.dtype}")
        return ref


def _read_into(ref: Any, start: int, out: np.ndarray, dtype: str) -> None:
    """Read ``len(out)`` elements of ``ref`` from flat element ``start`` into ``out`` (stored bytes)."""
    if isinstance(ref, TensorRef) and ref.is_contiguous():
        ref.read_numpy(start, len(out), out=out)
        return
    # Safetensors tensors and strided torch views read through torch, straight into our buffer (a
    # strided view is read whole by TensorRef.read: memory for that one tensor is not bounded).
    import torch

    target = torch.from_numpy(out.view(np.int16)).view(torch.bfloat16) if dtype == "bfloat16" else torch.from_numpy(out)
    ref.read(start, len(out), out=target)


def _as_number(raw: np.ndarray, dtype: str) -> np.ndarray:
    info = dtype_info(dtype)
    if not info.is_floating:
        return raw.astype(np.int64)
    if dtype.startswith("complex"):
        return raw.astype(np.complex128)
    if dtype == "bfloat16":
        return to_float32(raw, dtype).astype(np.float64)
    return raw.astype(np.float64)


class _Tally:
    __slots__ = ("a_at", "b_at", "bitwise", "first", "max_abs", "max_index", "max_rel", "n_differ", "n_outside")

    def __init__(self, bitwise: bool) -> None:
        self.bitwise = bitwise
        self.n_differ = self.n_outside = 0
        self.max_abs = self.max_rel = 0.0
        self.max_index: int | None = None
        self.a_at: float | None = None
        self.b_at: float | None = None
        self.first: list[int] = []


def _compare_chunk(t: _Tally, ra: np.ndarray, rb: np.ndarray, da: str, db: str, base: int, exact: bool,
                   atol: float, rtol: float) -> None:
    if da == db and np.array_equal(ra.view(np.uint8), rb.view(np.uint8)):
        return  # same bytes: equal by value too (NaN payloads included)
    t.bitwise = False
    a, b = _as_number(ra, da), _as_number(rb, db)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        equal = a == b
        if not exact:
            equal |= np.isnan(a) & np.isnan(b)
        differ = ~equal
        idx = np.flatnonzero(differ)
        if idx.size == 0:
            return  # e.g. another dtype holding the same values, or -0.0 vs 0.0
        av, bv = a[idx], b[idx]
        if exact:
            absd = np.abs(av.astype(np.float64) - bv.astype(np.float64))
            outside = np.ones(idx.size, dtype=bool)
        else:
            absd = np.abs(av - bv).astype(np.float64)
            finite = np.isfinite(av) & np.isfinite(bv)
            absd[~finite] = np.inf
            outside = ~(finite & (absd <= atol + rtol * np.abs(bv)))
        babs = np.abs(bv).astype(np.float64)
        rel = np.where(babs > 0, absd / np.where(babs > 0, babs, 1.0), np.inf)
        rel[np.isnan(rel)] = np.inf  # inf/inf where B is inf and A is not: as different as it gets
    t.n_differ += int(idx.size)
    t.n_outside += int(outside.sum())
    if len(t.first) < MAX_INDICES:
        t.first += (idx[: MAX_INDICES - len(t.first)] + base).tolist()
    k = int(np.argmax(absd))
    if t.max_index is None or absd[k] > t.max_abs:
        t.max_abs = float(absd[k])
        t.max_index = base + int(idx[k])
        t.a_at, t.b_at = _scalar(av[k]), _scalar(bv[k])
    t.max_rel = max(t.max_rel, float(rel.max()))


def _scalar(x: Any) -> float:
    return float(x.real) if isinstance(x, complex | np.complexfloating) else float(x)


def run_diff(plan: DiffPlan, cache_a: FileCache, cache_b: FileCache, *,
             on_progress: Callable[[int], None] | None = None) -> DiffReport:
    """Read every pair of ``plan`` in lockstep chunks of ``plan.chunk_numel`` elements and compare.

    Memory: one reused raw buffer per side and dtype, plus float64 working copies of one chunk.
    """
    compared, nbytes_read = _compare_pairs(plan, cache_a, cache_b, on_progress=on_progress)
    # CRC-32s of records read only partly are completed before anything is reported as equal.
    cache_a.finish_checks()
    cache_b.finish_checks()
    results: dict[tuple[str, str], TensorDiff] = {(d.name, d.role): d for d in plan.decided}
    results.update(compared)
    return DiffReport(plan.a, plan.b, plan.role, plan.atol, plan.rtol, plan.strict_dtype,
                      tuple(results[k] for k in plan.order), plan.excluded, nbytes_read)


def _pair_nbytes(p: PairPlan) -> int:
    return p.numel * (dtype_info(p.piece_a.dtype).itemsize + dtype_info(p.piece_b.dtype).itemsize)


def run_diff_distributed(plan: DiffPlan, cache_a: FileCache, cache_b: FileCache, group: Any, *,
                         on_progress: Callable[[int], None] | None = None) -> DiffReport:
    """:func:`run_diff` spread over the ranks of ``group`` (:class:`dsckpt.distributed.Group`): the pairs
    are split by bytes (:func:`dsckpt.distributed.split_by_nbytes`), every rank gets every result, and each
    zip record's CRC-32 is completed by the rank owning its file. Every rank returns the report the
    one-process run returns."""
    import dataclasses

    from . import crc
    from .distributed import export_segments, owned_checks, record_checks, split_by_nbytes

    group.agree({"order": [list(k) for k in plan.order],
                 "pairs": [[p.name, p.role, p.numel, p.piece_a.dtype, p.piece_b.dtype] for p in plan.pairs],
                 "chunk": plan.chunk_numel, "atol": plan.atol, "rtol": plan.rtol}, "the diff plan")
    mine = split_by_nbytes([_pair_nbytes(p) for p in plan.pairs], group.world_size)[group.rank]
    checks_a, checks_b = record_checks(cache_a), record_checks(cache_b)

    def share() -> tuple[dict[tuple[str, str], TensorDiff], int, Any, Any]:
        sub = dataclasses.replace(plan, pairs=tuple(plan.pairs[i] for i in mine))
        compared, nbytes = _compare_pairs(sub, cache_a, cache_b, on_progress=on_progress)
        return compared, nbytes, export_segments(checks_a), export_segments(checks_b)

    shares = group.step(share, "the comparison")

    def finish_crcs() -> None:
        crc.finish(owned_checks(checks_a, [s[2] for s in shares], group))
        crc.finish(owned_checks(checks_b, [s[3] for s in shares], group))

    group.step(finish_crcs, "the CRC-32 checks")
    results: dict[tuple[str, str], TensorDiff] = {(d.name, d.role): d for d in plan.decided}
    for s in shares:
        results.update(s[0])
    return DiffReport(plan.a, plan.b, plan.role, plan.atol, plan.rtol, plan.strict_dtype,
                      tuple(results[k] for k in plan.order), plan.excluded, sum(s[1] for s in shares))


def _compare_pairs(plan: DiffPlan, cache_a: FileCache, cache_b: FileCache, *,
                   on_progress: Callable[[int], None] | None) -> tuple[dict[tuple[str, str], TensorDiff], int]:
    """Compare every pair of ``plan`` (no CRC completion): results by (name, role), bytes read."""
    pool: dict[tuple[int, str], np.ndarray] = {}
    chunk = plan.chunk_numel
    results: dict[tuple[str, str], TensorDiff] = {}
    nbytes_read = 0
    for p in plan.pairs:
        ra = _PieceReader(p.piece_a, cache_a, p.name, pool, 0, chunk)
        rb = _PieceReader(p.piece_b, cache_b, p.name, pool, 1, chunk)
        da, db = p.piece_a.dtype, p.piece_b.dtype
        exact = not dtype_info(da).is_floating and not dtype_info(db).is_floating
        tally = _Tally(bitwise=da == db)
        for lo in range(0, p.numel, chunk):
            hi = min(p.numel, lo + chunk)
            xa, xb = ra.read(lo, hi), rb.read(lo, hi)
            _compare_chunk(tally, xa, xb, da, db, lo, exact, plan.atol, plan.rtol)
            n = xa.nbytes + xb.nbytes
            nbytes_read += n
            if on_progress is not None:
                on_progress(n)
        results[(p.name, p.role)] = _record(p, tally, exact, plan)
    return results, nbytes_read


def _record(p: PairPlan, t: _Tally, exact: bool, plan: DiffPlan) -> TensorDiff:
    da, db = p.piece_a.dtype, p.piece_b.dtype
    reason = ""
    if t.bitwise:
        status = Status.EQUAL
    elif t.n_outside == 0 and not (plan.strict_dtype and da != db):
        status = Status.CLOSE
    else:
        status = Status.DIFFERENT
        if t.n_outside == 0:
            reason = "dtypes differ (strict dtype)"
    return TensorDiff(
        p.name, p.role, status, p.shape, p.shape, da, db, p.copy_a, p.copy_b, p.numel, t.bitwise, t.n_differ,
        t.n_outside, t.max_abs, t.max_rel, t.max_index, t.a_at, t.b_at, tuple(t.first), exact, reason,
    )


# --------------------------------------------------------------------------------------------
# Front door


def open_input(path: str | os.PathLike[str], *, tag: str | None = None) -> tuple[DiffInput, FileCache]:
    """Open one side (see :func:`dsckpt.scan.open_target`). ``tag`` is for DeepSpeed checkpoints only."""
    from .scan import open_target
    from .state_dict_files import detect_target

    if tag is not None and detect_target(path) is not TargetKind.DEEPSPEED:
        raise UsageError(f"a tag was given for '{path}', which is not a DeepSpeed checkpoint")
    logical, cache, kind = open_target(path, tag=tag)
    return DiffInput(Path(path), kind, logical), cache


def prepare_diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, tag_a: str | None = None,
                 tag_b: str | None = None, role: DiffRole | str = DiffRole.VALUE, atol: float = 0.0,
                 rtol: float = 0.0, strict_dtype: bool = False, exclude_frozen: bool = False,
                 chunk_numel: int = DEFAULT_CHUNK_NUMEL) -> tuple[DiffPlan, FileCache, FileCache]:
    """Open both sides and plan the comparison (no tensor data read)."""
    side_a, cache_a = open_input(a, tag=tag_a)
    side_b, cache_b = open_input(b, tag=tag_b)
    plan = plan_diff(side_a, side_b, role=role, atol=atol, rtol=rtol, strict_dtype=strict_dtype,
                     exclude_frozen=exclude_frozen, chunk_numel=chunk_numel)
    return plan, cache_a, cache_b


def diff(a: str | os.PathLike[str], b: str | os.PathLike[str], *, tag_a: str | None = None,
         tag_b: str | None = None, role: DiffRole | str = DiffRole.VALUE, atol: float = 0.0, rtol: float = 0.0,
         strict_dtype: bool = False, exclude_frozen: bool = False, chunk_numel: int = DEFAULT_CHUNK_NUMEL,
         on_progress: Callable[[int], None] | None = None) -> DiffReport:
    """Compare ``a`` with ``b`` (B is the reference of the relative tolerance). See the module docstring."""
    plan, cache_a, cache_b = prepare_diff(a, b, tag_a=tag_a, tag_b=tag_b, role=role, atol=atol, rtol=rtol,
                                          strict_dtype=strict_dtype, exclude_frozen=exclude_frozen,
                                          chunk_numel=chunk_numel)
    return run_diff(plan, cache_a, cache_b, on_progress=on_progress)
