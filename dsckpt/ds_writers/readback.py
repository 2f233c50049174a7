"""Read a written checkpoint back and compare it with its source, stored copy by stored copy.

The output of a writer is re-opened through :mod:`dsckpt.readers` -- the same code every other
command trusts -- so a wrong offset, length or name in a plan shows as a difference in the logical
model, before the output is moved into place.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError
from ..model import LogicalCheckpoint, Piece, Role, contiguous_fragments
from .facts import entries_by_name
from .plan import LayoutPlan, source_layout_stage

__all__ = ["VERIFY_CHUNK_NBYTES", "VERIFY_SAMPLES", "VERIFY_WINDOW_NUMEL", "compare_checkpoints", "verify_written"]


VERIFY_WINDOW_NUMEL = 64  # elements compared around each fragment boundary (quick verification)
VERIFY_SAMPLES = 8  # evenly spaced windows per stored copy (quick verification)
VERIFY_CHUNK_NBYTES = 8 << 20  # full verification compares this much at a time


def verify_written(plan: LayoutPlan, new_root: Path, src_cache: Any, *, full: bool) -> int:
    """Re-open the output and compare every stored copy of every tensor with the source.

    Quick: windows of values around every fragment boundary of both sides (where a wrong offset or
    length would show), at both ends, and at evenly spaced points. Full: every value. Values are
    compared as bytes (bit for bit; NaN equals NaN). Returns the number of copies compared.
    """
    from ..readers import FileCache, read_checkpoint

    src = read_checkpoint(plan.source_root, tag=plan.tag, cache=src_cache, tied_keys=dict(plan.tied_keys))
    new_cache = FileCache()
    new = read_checkpoint(new_root, tag=plan.tag, cache=new_cache)
    if (new.dp_world_size, max(1, new.tp_world_size)) != (plan.world_size, plan.tp_size):
        raise CorruptCheckpointError(
            f"verification failed: the written checkpoint records dp_world_size={new.dp_world_size} and "
            f"tensor parallelism {new.tp_world_size}, expected {plan.world_size} and {plan.tp_size}; "
            "nothing was written")
    if (source_layout_stage(new), new.optimizer_wrapper) != (plan.zero_stage, plan.optimizer_wrapper):
        raise CorruptCheckpointError(
            f"verification failed: the written checkpoint reads as ZeRO stage {source_layout_stage(new)} "
            f"({new.optimizer_wrapper}), expected {plan.zero_stage} ({plan.optimizer_wrapper}); nothing was written")
    layout = plan.parallel.tp
    if plan.tp_size != plan.source_tp_size and layout is not None and layout.source == "megatron":
        # another TP size re-pads a Megatron vocabulary: the real rows are compared, the new padding must be zeros
        _check_zero_padding(new, new_cache, layout)
        return compare_checkpoints(src, src_cache, new, new_cache, full=full, padding=False,
                                   recast=plan.precision_change)
    return compare_checkpoints(src, src_cache, new, new_cache, full=full, recast=plan.precision_change)


def _check_zero_padding(new: LogicalCheckpoint, cache: Any, layout: Any) -> None:
    """Every stored copy of every vocabulary padding row of ``new`` is zero, and there are as many padding rows as
    ``layout`` pads (every value read: padding rows are a few rows per param)."""
    from ..writers.torch_stream import element_nbytes

    problems: list[str] = []
    for e in new.entries:
        cut = layout.name_to_cut.get(e.name)
        if e.tied_to is not None or cut is None:
            continue
        if e.padding_rows != cut.padding_rows:
            problems.append(f"'{e.name}' has {e.padding_rows} vocabulary padding rows, expected {cut.padding_rows}")
            continue
        for p in e.padding:
            item = element_nbytes(p.dtype)
            if any(_read_bytes(p, 0, p.numel, item, cache)):
                problems.append(f"'{e.name}' ({p.label} padding rows) is not zero")
    if problems:
        raise CorruptCheckpointError("verification failed: " + "; ".join(problems[:10])
                                     + ". Nothing was written. This is a dsckpt bug: please report it")


def compare_checkpoints(src: LogicalCheckpoint, src_cache: Any, new: LogicalCheckpoint, new_cache: Any, *,
                        full: bool, padding: bool = True, recast: Any = None) -> int:
    """Compare every stored copy (master, moments, module) of every tensor of ``new`` with ``src``, vocabulary
    padding rows included (:attr:`~dsckpt.model.TensorEntry.padding`; not with ``padding=False``: a universal
    folder, which keeps none) (quick: sampled windows, full: every value); ``recast``: the target's
    :class:`~.precision.PrecisionTarget` of a precision change, whose module copies are compared, every value, with
    the cast they must be (:func:`.precision.module_copy_problem`); raise :class:`CorruptCheckpointError`
    listing what differs. Returns the number of copies compared."""
    from ..writers.torch_stream import element_nbytes

    src_entries = entries_by_name(src)
    new_entries = entries_by_name(new)
    if set(src_entries) != set(new_entries):
        diff = sorted(set(src_entries) ^ set(new_entries))
        raise CorruptCheckpointError(f"verification failed: tensors differ between input and output: {diff[:5]}")
    problems: list[str] = []
    checked = 0
    for name, e in src_entries.items():
        if e.tied_to is not None:
            continue
        n = new_entries[name]
        if n.shape != e.shape:
            problems.append(f"'{name}' has shape {list(n.shape)}, expected {list(e.shape)}")
            continue
        if padding and n.padding_rows != e.padding_rows:
            problems.append(f"'{name}' has {n.padding_rows} vocabulary padding rows, expected {e.padding_rows}")
            continue
        padded = dict.fromkeys((p.role, p.state_key) for p in e.padding) if padding else {}
        for role, a, b, what in [*_copies_to_compare(e, n),
                                 *((r, e.padding_piece(r, 0, k), n.padding_piece(r, 0, k),
                                    f"{k or r.value} padding rows") for r, k in padded)]:
            if role is Role.MASTER and (a is None) != (b is None) and e.trainable:
                # a stage-0 fp32 save keeps no master: its module weights (and their padding rows) are the master
                side = e if a is None else n
                module = (side.padding_piece(Role.MODULE) if what.endswith("padding rows")
                          else side.piece(Role.MODULE))
                module = module if module is not None and module.dtype == "float32" else None
                a, b = (module, b) if a is None else (a, module)
            if recast is not None and role is Role.MODULE and b is not None and not what.endswith("padding rows"):
                from .precision import module_copy_problem

                problem = module_copy_problem(e, b, src_cache, new_cache, recast)
                if problem is not None:
                    problems.append(problem)
                checked += 1
                continue
            if recast is not None and role is Role.MODULE and b is not None:  # module padding rows, recast
                from .precision import padding_copy_problem

                problem = padding_copy_problem(e, b, src_cache, new_cache, recast)
                if problem is not None:
                    problems.append(problem)
                checked += 1
                continue
            if a is None or b is None:
                if (a is None) != (b is None) and role is not Role.MODULE:
                    problems.append(f"'{name}' lost its {what} copy")
                continue
            if a.dtype != b.dtype or a.numel != b.numel:
                problems.append(f"'{name}' ({what}) is {b.dtype}[{b.numel}], expected {a.dtype}[{a.numel}]")
                continue
            item = element_nbytes(a.dtype)
            if full:
                step = max(1, VERIFY_CHUNK_NBYTES // item)
                windows = [(lo, min(step, a.numel - lo)) for lo in range(0, a.numel, step)]
            else:
                windows = _sample_windows(a, b)
            for lo, numel in windows:
                if _read_bytes(a, lo, numel, item, src_cache) != _read_bytes(b, lo, numel, item, new_cache):
                    problems.append(f"'{name}' ({what}) differs in elements [{lo}, {lo + numel})")
                    break
            checked += 1
    if problems:
        raise CorruptCheckpointError(
            "verification failed: " + "; ".join(problems[:10]) + (f" (and {len(problems) - 10} more)"
                                                                   if len(problems) > 10 else "")
            + ". Nothing was written. This is a dsckpt bug: please report it")
    return checked


def _copies_to_compare(e: Any, n: Any) -> list[tuple[Role, Piece | None, Piece | None, str]]:
    """Per stored copy (master, each optimizer state, module), the primary copies of source ``e`` and output ``n``
    and what they are; and every further output copy that must equal a source copy bit for bit (a param
    replicated on every tensor-parallel rank: ``same_as``), against the source copy of the same replica number,
    or the source's primary where it has no such replica."""
    out: list[tuple[Role, Piece | None, Piece | None, str]] = []
    keys = dict.fromkeys((*e.state_keys, *n.state_keys))
    for role, key in ((Role.MASTER, None), *((Role.OPTIM_STATE, k) for k in keys), (Role.MODULE, None)):
        def primary(entry: Any, role: Role = role, key: str | None = key) -> Piece | None:
            return entry.state_piece(key) if key is not None else entry.piece(role)
        what = key or role.value
        out.append((role, primary(e), primary(n), what))
        src = {p.replica: p for p in e.pieces if (p.role, p.state_key) == (role, key)}
        for p in n.pieces:
            if (p.role, p.state_key) == (role, key) and p.same_as is not None:
                out.append((role, src.get(p.replica, primary(e)), p, what))
    return out


def _sample_windows(a: Piece, b: Piece) -> list[tuple[int, int]]:
    """Element windows ``(start, numel)`` to compare for a quick verification of ``a`` vs ``b``."""
    total = a.numel
    w = VERIFY_WINDOW_NUMEL
    points = {0, total}
    points.update(f.dst_offset for f in a.fragments)
    points.update(f.dst_offset for f in b.fragments)
    points.update(total * k // (VERIFY_SAMPLES + 1) for k in range(1, VERIFY_SAMPLES + 1))
    spans = sorted((max(0, p - w // 2), min(total, p + w // 2)) for p in points)
    merged: list[list[int]] = []
    for lo, hi in spans:
        if hi <= lo:
            continue
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return [(lo, hi - lo) for lo, hi in merged]


def _read_bytes(piece: Piece, start: int, numel: int, item: int, cache: Any) -> bytes:
    """Raw bytes of elements ``[start, start + numel)`` of a piece, read through
    :meth:`TensorRef.read_numpy` (``pread``, CRC-checked, no torch) for contiguous refs."""
    out = bytearray()
    end = start + numel
    for f in contiguous_fragments(piece):
        lo, hi = max(start, f.dst_offset), min(end, f.dst_offset + f.numel)
        if lo >= hi:
            continue
        ref = cache.tensor(f.file, f.key)
        first = f.src_offset + (lo - f.dst_offset)
        if not ref.is_contiguous():  # strided views only (rare): torch does the gather
            import torch

            t = ref.read(first, hi - lo)
            out += t.reshape(-1).view(torch.uint8).numpy().tobytes()
            continue
        out += ref.read_numpy(first, hi - lo).data.cast("B")  # raises if the ref is shorter than the metadata
    return bytes(out)
