"""The one logical checkpoint that every reader produces and every command consumes.

A :class:`LogicalCheckpoint` says what the model is (names, shapes, dtypes, trainable / frozen /
tied, buffers) and where each stored copy of each tensor lives, as :class:`Fragment` s: element
ranges of flat tensors inside named files. No tensor data is held here.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from typing_extensions import deprecated

from .optimizer_group import OptimizerGroup

if TYPE_CHECKING:
    from .binding import Ambiguity
    from .parallel_layout import AutoEpLayout, MoeLayout, PipelineRecord, TpLayout

__all__ = [
    "ZERO_FILL",
    "DeprecatedStateRole",
    "Fragment",
    "Kind",
    "LogicalCheckpoint",
    "MoeLayout",
    "OptimizerGroup",
    "Piece",
    "Precision",
    "Role",
    "TensorEntry",
    "contiguous_fragments",
    "reading_fragments",
    "runs_overlapping",
]


class Kind(enum.Enum):
    PARAM = "param"
    BUFFER = "buffer"


@dataclass(frozen=True)
class DeprecatedStateRole:
    """What ``Role.EXP_AVG`` and ``Role.EXP_AVG_SQ`` give since dsckpt 0.2.0: the name of one optimizer state, which
    :meth:`TensorEntry.piece`, :meth:`TensorEntry.padding_piece` and ``Checkpoint.tensor(name, role=...)`` take as
    0.1.0 took those members (each reads the :attr:`Role.OPTIM_STATE` copy whose ``state_key`` is ``state_key``).

    Deprecated with the two names (kept through 0.2.x, removed in 0.3.0): read a state with
    ``Checkpoint.tensor(name, state="exp_avg")`` or :meth:`TensorEntry.state_piece`. ``name`` and ``value`` are
    what the old members' were (``"EXP_AVG"``, ``"exp_avg"``)."""

    name: str
    state_key: str

    @property
    def value(self) -> str:
        return self.state_key


class _RoleType(enum.EnumMeta):
    """Role's metaclass, only for the two names 0.1.0 published as members. An enum member cannot carry the state key
    that reading a state now needs (``Role.OPTIM_STATE`` + ``state=``), so each old name is a read-only property of
    the class that warns (``DeprecationWarning``, and PEP 702's ``@deprecated`` for type checkers) and gives a
    :class:`DeprecatedStateRole`. Iterating ``Role`` and ``Role.__members__`` show the three real members only."""

    @property
    @deprecated("Role.EXP_AVG is deprecated since dsckpt 0.2.0 and will be removed in 0.3.0: read the Adam moment with "
                "ckpt.tensor(name, state=\"exp_avg\") (the Role.OPTIM_STATE piece entry.state_piece(\"exp_avg\"))")
    def EXP_AVG(cls) -> DeprecatedStateRole:
        return DeprecatedStateRole("EXP_AVG", "exp_avg")

    @property
    @deprecated("Role.EXP_AVG_SQ is deprecated since dsckpt 0.2.0 and will be removed in 0.3.0: read the Adam moment "
                "with ckpt.tensor(name, state=\"exp_avg_sq\") (the Role.OPTIM_STATE piece "
                "entry.state_piece(\"exp_avg_sq\"))")
    def EXP_AVG_SQ(cls) -> DeprecatedStateRole:
        return DeprecatedStateRole("EXP_AVG_SQ", "exp_avg_sq")


class Role(enum.Enum, metaclass=_RoleType):
    """What a stored copy of a tensor is.

    ``Role.EXP_AVG`` / ``Role.EXP_AVG_SQ`` (dsckpt 0.1.0) still work where a role is taken, with a
    ``DeprecationWarning``: see :class:`DeprecatedStateRole`."""

    MASTER = "master"  # fp32 master weights (optimizer side)
    MODULE = "module"  # the module's copy (16-bit under fp16/bf16, fp32 otherwise); buffers too
    # one per-element state tensor of the optimizer ("exp_avg", "momentum_buffer", "sum", ...): Piece.state_key
    OPTIM_STATE = "optim_state"


class Precision(enum.Enum):
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"


#: The ``file`` of a :class:`Fragment` whose elements are zeros written by a writer, not read from any file: the
#: new vocabulary padding rows of a tensor-parallel resize (:func:`dsckpt.tensor_parallel.rank_view`), which
#: DeepSpeed's universal loader fills with zeros too. Readers never make one; a NUL byte names no file on any OS.
ZERO_FILL = Path("\x00zeros")


@dataclass(frozen=True)
class Fragment:
    """``numel`` elements of the flat tensor at ``key`` in ``file``, starting at ``src_offset``,
    which land at ``dst_offset`` of the flattened logical tensor.

    Both sides are contiguous unless ``run_numel`` is set: then the elements move in runs of ``run_numel``
    (``numel`` is a multiple of it), run ``i`` from ``src_offset + i * src_stride`` to
    ``dst_offset + i * dst_stride``. ``src_stride`` 0 means ``run_numel``: the runs follow each other in the
    source, as in every fragment a reader makes (a tensor-parallel row slice is stored contiguously and lands
    strided in the full tensor). A strided source is the other direction: a target rank of a TP split takes
    part of each source row (see :mod:`dsckpt.tensor_parallel` for why one strided fragment rather than one per
    row). A fragment whose runs follow each other on both sides is not :attr:`strided`. Consumers needing
    contiguous fragments iterate :meth:`runs` for one tensor at a time; :func:`contiguous_fragments` does that
    for a piece; those reading the source in one go read ``[src_offset, src_end)``, gaps included."""

    file: Path
    key: tuple[Any, ...]
    src_offset: int
    numel: int
    dst_offset: int
    rank: int | None = None
    run_numel: int = 0
    dst_stride: int = 0
    src_stride: int = 0

    @property
    def src_step(self) -> int:
        """Source elements from one run's start to the next (``run_numel`` unless the source is strided)."""
        return self.src_stride or self.run_numel

    @property
    def src_strided(self) -> bool:
        return 0 < self.run_numel < self.numel and self.src_step != self.run_numel

    @property
    def dst_strided(self) -> bool:
        return 0 < self.run_numel < self.numel and self.dst_stride != self.run_numel

    @property
    def strided(self) -> bool:
        """Whether the runs are apart on either side."""
        return self.src_strided or self.dst_strided

    @property
    def src_end(self) -> int:
        """One past the last source element: the span ``[src_offset, src_end)`` holds the runs and their gaps."""
        return self.src_index(self.numel - 1) + 1 if self.numel > 0 else self.src_offset

    def runs(self) -> Iterator[Fragment]:
        """This fragment as contiguous fragments, in source order."""
        if not self.strided:
            yield Fragment(self.file, self.key, self.src_offset, self.numel, self.dst_offset, self.rank)
            return
        r, step = self.run_numel, self.src_step
        for i in range(self.numel // r):
            yield Fragment(self.file, self.key, self.src_offset + i * step, r, self.dst_offset + i * self.dst_stride,
                           self.rank)

    def src_index(self, k: int) -> int:
        """Flat index, in the stored tensor, of this fragment's ``k``-th element."""
        if not self.src_strided:
            return self.src_offset + k
        return self.src_offset + (k // self.run_numel) * self.src_step + k % self.run_numel

    def window(self, lo: int, hi: int) -> tuple[int, int]:
        """``(k0, k1)``: this fragment's elements whose logical index lies in ``[lo, hi)`` are ``[k0, k1)`` (the
        logical index grows with ``k``, so they are consecutive); ``k0 == k1`` when there are none."""
        if not self.dst_strided:
            k0 = min(max(lo - self.dst_offset, 0), self.numel)
            return k0, max(k0, min(hi - self.dst_offset, self.numel))
        r, stride, d0 = self.run_numel, self.dst_stride, self.dst_offset
        runs = runs_overlapping(d0, r, stride, self.numel // r, lo, hi)
        if not runs:
            return 0, 0
        first, last = runs.start, runs.stop
        k0 = first * r + max(0, lo - (d0 + first * stride))
        return k0, max(k0, last * r - max(0, d0 + (last - 1) * stride + r - hi))

    def dst_index(self, k: int) -> int:
        """Flat logical index of this fragment's ``k``-th element."""
        if not self.dst_strided:
            return self.dst_offset + k
        return self.dst_offset + (k // self.run_numel) * self.dst_stride + k % self.run_numel


def runs_overlapping(start: int, run: int, stride: int, n: int, lo: int, hi: int) -> range:
    """The indices ``j < n`` of the runs ``[start + j * stride, start + j * stride + run)`` that overlap
    ``[lo, hi)``: from the first run ending after ``lo`` to the last starting before ``hi``."""
    return range(max(0, (lo - run - start) // stride + 1), min(n, -(-(hi - start) // stride)))


def reading_fragments(piece: Piece) -> tuple[list[Fragment], list[Fragment]]:
    """``piece``'s fragments as readers of logical windows want them: the contiguous ones sorted by destination
    (to bisect), and those strided in the logical tensor (TP row slices), each read a window at a time
    (:meth:`Fragment.window`) rather than run by run; a fragment strided only in its source comes as its runs."""
    frags = [r for f in piece.fragments for r in (f.runs() if f.src_strided else (f,))]
    return sorted((f for f in frags if not f.strided), key=lambda f: f.dst_offset), [f for f in frags if f.strided]


def contiguous_fragments(piece: Piece) -> tuple[Fragment, ...]:
    """``piece``'s fragments with strided ones expanded into their runs, sorted by destination."""
    if not any(f.strided for f in piece.fragments):
        return tuple(sorted(piece.fragments, key=lambda f: f.dst_offset))
    return tuple(sorted((r for f in piece.fragments for r in f.runs()), key=lambda f: f.dst_offset))


@dataclass(frozen=True)
class Piece:
    """One stored copy of a logical tensor: its role, stored dtype, and where its elements are.

    ``replica`` numbers copies of the same tensor (e.g. stage-3 buffers on every rank, which DP ranks may
    update apart). ``same_as``: the replica number of a copy this one must equal bit for bit (a param
    replicated across tensor-parallel ranks); ``verify`` compares them. ``state_key``: for an
    :attr:`Role.OPTIM_STATE` copy, the optimizer's own key of that state ("exp_avg", "exp_avg_sq",
    "momentum_buffer", "sum", "max_exp_avg_sq", ...); None for every other role.
    """

    role: Role
    dtype: str
    fragments: tuple[Fragment, ...]
    replica: int = 0
    same_as: int | None = None
    state_key: str | None = None

    @property
    def numel(self) -> int:
        return sum(f.numel for f in self.fragments)

    @property
    def label(self) -> str:
        """What this copy is, as messages and reports name it: the state key of an optimizer state
        ("exp_avg"), else the role ("master", "module")."""
        return self.state_key if self.role is Role.OPTIM_STATE and self.state_key else self.role.value

    @property
    def copy_id(self) -> tuple[Role, str | None, int]:
        """``(role, state_key, replica)``: which stored copy of its tensor this is (unique within an entry)."""
        return self.role, self.state_key, self.replica

    def same_copy(self, other: Piece) -> bool:
        """Whether ``other`` is the same stored copy (role, state key, replica) of a tensor, e.g. on another rank."""
        return self.copy_id == other.copy_id


@dataclass(frozen=True)
class TensorEntry:
    name: str
    shape: tuple[int, ...]
    kind: Kind
    trainable: bool
    pieces: tuple[Piece, ...]
    tied_to: str | None = None
    group: int | None = None
    # The files do not determine whether this param owns an optimizer-side tensor (see
    # LogicalCheckpoint.ambiguities): ``trainable`` is then unknown and no master/moments are attached.
    ambiguous: bool = False
    # Stored values past the logical shape that training keeps: the vocabulary padding rows of a tensor-parallel
    # checkpoint (Megatron pads the vocabulary to a multiple of make_vocab_size_divisible_by x TP; its
    # vocab-parallel loss trains those rows). They are rows ``[shape[0], shape[0] + padding_rows)`` of the stored
    # tensor, one Piece per stored copy (same role / replica as in ``pieces``) in flat coordinates of those rows.
    # Not part of the tensor: commands that export or compare its values (to-fp32, diff, universal) leave them
    # out, as DeepSpeed's ds_to_universal does; scan checks them and reshard carries them where the padded size
    # is kept (dsckpt.tensor_parallel.rank_view).
    padding: tuple[Piece, ...] = ()
    padding_rows: int = 0

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def padding_numel(self) -> int:
        return self.padding_rows * math.prod(self.shape[1:])

    def padding_piece(self, role: Role | DeprecatedStateRole, replica: int = 0,
                      state_key: str | None = None) -> Piece | None:
        """The padding values of the stored copy with ``role``, ``replica`` (and ``state_key``), or None."""
        copy_id = ((Role.OPTIM_STATE, role.state_key, replica) if isinstance(role, DeprecatedStateRole)
                   else (role, state_key, replica))
        return next((p for p in self.padding if p.copy_id == copy_id), None)

    def padding_of(self, piece: Piece) -> Piece | None:
        """The padding values of the same stored copy as ``piece``, or None."""
        return next((p for p in self.padding if p.same_copy(piece)), None)

    def piece(self, role: Role | DeprecatedStateRole) -> Piece | None:
        """The primary copy with ``role`` (replica 0), or None. For optimizer states use :meth:`state_piece`."""
        if isinstance(role, DeprecatedStateRole):
            return self.state_piece(role.state_key)
        for p in self.pieces:
            if p.role is role and p.replica == 0:
                return p
        return None

    def state_piece(self, key: str, replica: int = 0) -> Piece | None:
        """The copy of the optimizer state ``key`` ("exp_avg", "momentum_buffer", ...) with ``replica``, or None."""
        return next((p for p in self.pieces
                     if p.role is Role.OPTIM_STATE and p.state_key == key and p.replica == replica), None)

    @property
    def state_keys(self) -> tuple[str, ...]:
        """The keys of this tensor's optimizer states, in the optimizer's order."""
        return tuple(dict.fromkeys(p.state_key for p in self.pieces
                                   if p.role is Role.OPTIM_STATE and p.state_key is not None))

    @property
    def state_pieces(self) -> tuple[Piece, ...]:
        """The primary (replica 0) copy of each optimizer state, in the optimizer's order."""
        return tuple(p for p in self.pieces if p.role is Role.OPTIM_STATE and p.replica == 0)

    @property
    def stored_dtype(self) -> str:
        """dtype of the module copy (what the model was trained in), else of any copy."""
        p = self.piece(Role.MODULE) or self.pieces[0]
        return p.dtype

    def source_for_fp32(self) -> Piece:
        """The most precise copy: the fp32 master if there is one, else the module copy."""
        p = self.piece(Role.MASTER) or self.piece(Role.MODULE)
        assert p is not None, f"{self.name} has no readable copy"
        return p


@dataclass(frozen=True)
class LogicalCheckpoint:
    root: Path
    tag: str
    tag_dir: Path
    layout: str  # human-readable reader name, e.g. "zero2", "zero3", "stage0-fused", "pipeline"
    zero_stage: int
    precision: Precision
    dp_world_size: int
    pp_world_size: int
    tp_world_size: int
    ds_version: str | None
    global_steps: int | None
    global_samples: int | None
    optimizer_step: int | None
    optimizer_wrapper: str
    entries: tuple[TensorEntry, ...]
    files: tuple[Path, ...]
    ds_config: dict[str, Any] | None = None
    notes: tuple[str, ...] = field(default_factory=tuple)
    # Bindings the files leave open (stage 0 only today); see dsckpt.binding and require_unambiguous().
    ambiguities: tuple[Ambiguity, ...] = field(default_factory=tuple)
    moe: MoeLayout | None = None  # Mixture-of-Experts checkpoints only
    tensor_parallel: TpLayout | None = None  # TP > 1 only: how each param is cut across TP ranks
    # (alias, source) of tied params whose source the save left out (save_checkpoint(exclude_frozen_parameters=True),
    # as the HF Trainer does for PEFT models): the alias is exported as saved (ZeRO-1/2 keep its 16-bit value in
    # 'module'; ZeRO-3 keeps an empty placeholder, so there it has no entry)
    excluded_ties: tuple[tuple[str, str], ...] = ()
    autoep: AutoEpLayout | None = None  # DeepSpeed AutoEP (HF MoE models) only: how the experts are cut
    pipeline: PipelineRecord | None = None  # pipeline checkpoints only: layer files and each stage's params
    # The optimizer's param groups as saved (ZeRO-1/2/3, BF16_Optimizer and stage-0 readers; () elsewhere)
    optimizer_groups: tuple[OptimizerGroup, ...] = ()
    # The optimizer as ds_config names it ("AdamW", "SGD", "RMSprop" ...); None when the config names none (a
    # client optimizer object)
    optimizer_type: str | None = None

    def __iter__(self) -> Iterator[TensorEntry]:
        return iter(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def entry(self, name: str) -> TensorEntry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(name)

    @property
    def params(self) -> list[TensorEntry]:
        return [e for e in self.entries if e.kind is Kind.PARAM]

    @property
    def buffers(self) -> list[TensorEntry]:
        return [e for e in self.entries if e.kind is Kind.BUFFER]

    @property
    def tied(self) -> dict[str, str]:
        return {e.name: e.tied_to for e in self.entries if e.tied_to is not None}

    def require_unambiguous(self, purpose: str, *, values: bool = False, flags: bool = False,
                            moments: bool = False, names: set[str] | None = None) -> None:
        """Raise :class:`~dsckpt.binding.AmbiguousBindingError` if what ``purpose`` needs depends on a
        binding the files leave open: exported ``values`` (only when the choices give different values),
        trainable/frozen ``flags``, or optimizer ``moments``; restricted to ``names`` if given."""
        from .binding import AmbiguousBindingError

        unkeyed = self.pipeline.unkeyed_tied if self.pipeline is not None else ()
        if unkeyed and (names is None or any(n.startswith("tied_modules.") for n in names)):
            # DeepSpeed's own fp32 stage-0 pipeline save (readers/pipeline_binding.py): read with a stand-in key
            layers = ", ".join(f"layer_{i:02d}-model_states.pt" for i in unkeyed)
            raise AmbiguousBindingError(
                f"'{self.tag_dir}': {purpose} names the tied module(s) saved in {layers}, whose TiedLayerSpec key no "
                "file states (DeepSpeed's own fp32 pipeline save without ZeRO); dsckpt does not guess it, so nothing "
                "was written. 'dsckpt reshard CKPT OUT -n N "
                + " ".join(f"--tied-key {i}=KEY" for i in unkeyed) + "' writes a copy that names it")
        blocking = []
        for amb in self.ambiguities:
            if names is not None and not names.intersection(amb.names):
                continue
            if flags or moments or (values and not amb.values_agree):
                blocking.append(amb)
        if not blocking:
            return
        why = "; ".join(a.describe() for a in blocking)
        raise AmbiguousBindingError(
            f"'{self.tag_dir}': {purpose} depends on which params own stored optimizer tensors, and the "
            f"files do not say: {why}. dsckpt does not guess, so nothing was written; 'dsckpt info' lists the "
            "names, and what does not depend on the binding (scan; to-fp32 without --exclude-frozen when the "
            "values agree) still works"
        )
