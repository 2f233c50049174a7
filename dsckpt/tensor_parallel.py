"""How a tensor-parallel checkpoint cuts each param across TP ranks: one frozen record, pure arithmetic, no I/O.

Under tensor parallelism (DeepSpeed AutoTP, or Megatron-style models passed to DeepSpeed with an ``mpu``) every TP
rank is an ordinary ZeRO / ``BF16_Optimizer`` checkpoint of its *local* slices, under the same param names on every
rank (tests/fixtures/README.md, "AutoTP fixtures"). How the slices make the full tensor is recorded by the training
code itself in ``universal_checkpoint_info`` (model-states files): category pattern lists (replicated, row-parallel,
vocabulary, sub-params) and, for AutoTP 0.4, an ``affine_map`` per param (checked against the patterns,
:func:`affine_disagreement`). :func:`tp_layout_from_record` turns that
record plus every rank's local shapes into a :class:`~dsckpt.parallel_layout.TpLayout`: per param a
:class:`~dsckpt.parallel_layout.ParamCut` (split kind, dim,
per-rank widths of each sub-param, vocabulary rows kept). The merge rules are DeepSpeed 0.19.8's
``ds_to_universal.merge_tp_slices``; a split is never inferred from shapes.

:meth:`~dsckpt.parallel_layout.ParamCut.rank_blocks` (the general vocabulary of cuts lives in
:mod:`dsckpt.parallel_layout`, below every record that produces one) says where TP rank ``t``'s local flat elements
land in the flattened full tensor as :class:`~dsckpt.parallel_layout.TpBlock` s, and :func:`compose` maps a reader's
local :class:`~dsckpt.model.Fragment` through them. A row-parallel slice (split on dim 1) is strided in the full
tensor; it becomes **one strided fragment** (``run_numel``/``dst_stride``, see :class:`~dsckpt.model.Fragment`)
plus at most a partial head and tail run where a ZeRO partition boundary falls inside a row, instead of one fragment
per row: a 70B model's row-parallel weights at TP 8 would otherwise carry ~65k fragments per tensor per stored copy
(~40M in all), held for the whole run. Consumers that need contiguous runs expand one tensor's fragments at a time
(:meth:`Fragment.runs`).

At another TP size (:func:`resize_layout`) an AutoTP record takes AutoTP's own width rule
(:mod:`dsckpt.autotp_widths`) and a Megatron-style record Megatron's equal parts (:func:`megatron_layout`), its
vocabulary re-padded to a multiple of ``make_vocab_size_divisible_by`` x TP with zero rows (:func:`rank_view`), as
DeepSpeed's ``ds_to_universal`` + universal loader route does.

Expert parallelism is described in the same vocabulary (:mod:`dsckpt.parallel_layout`, which holds the rank
arithmetic of every parallel dimension): an expert-parallel rank's local experts are a dim-0 cut of a stacked
``(num_experts, ...)`` logical tensor, i.e. a :class:`ParamCut` of kind ``COLUMN`` over the expert index.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from .autotp_widths import target_layout
from .errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError, first_of
from .model import ZERO_FILL, Fragment, LogicalCheckpoint, Piece, TensorEntry, runs_overlapping
from .parallel_layout import ParamCut, SplitKind, TpBlock, TpLayout

__all__ = ["affine_disagreement", "compose", "megatron_layout", "megatron_record_at", "padded_vocab_size", "rank_view",
           "resize_layout", "tp_layout_from_record"]


def compose(frag: Fragment, blocks: Sequence[TpBlock]) -> list[Fragment]:
    """Map a contiguous fragment of a TP rank's *local* flat tensor (``dst_offset`` in local coordinates) to
    fragments of the *full* flat tensor: contiguous ones, and for a strided block one strided fragment of whole
    runs plus partial head/tail runs. Local elements no block covers are left out: the readers map vocabulary
    padding rows through :meth:`ParamCut.padding_blocks` into the entry's padding pieces instead."""
    assert not frag.run_numel, "readers give contiguous local fragments"
    out: list[Fragment] = []
    lo, hi = frag.dst_offset, frag.dst_offset + frag.numel
    for b in blocks:
        x, y = max(lo, b.local_offset), min(hi, b.local_offset + b.numel)
        if x >= y:
            continue
        kx, ky = x - b.local_offset, y - b.local_offset
        r = b.run_numel
        if not r:
            spans = [(kx, ky)]
        else:  # a partial head run, the whole runs (one strided fragment), a partial tail run
            head_end = min(ky, -(-kx // r) * r)
            body_end = max(head_end, (ky // r) * r)
            spans = [(kx, head_end), (head_end, body_end), (body_end, ky)]
        for k0, k1 in spans:
            n = k1 - k0
            if n <= 0:
                continue
            src = frag.src_offset + (x - lo) + (k0 - kx)
            if r and n > r:
                out.append(Fragment(frag.file, frag.key, src, n, b.full_index(k0), frag.rank,
                                    run_numel=r, dst_stride=b.full_stride))
            else:
                out.append(Fragment(frag.file, frag.key, src, n, b.full_index(k0), frag.rank))
    return out


# --------------------------------------------------------------------------------------------
# The record (``universal_checkpoint_info``, DeepSpeed 0.19.8 deepspeed/checkpoint/constants.py names)

_REPLICATED = "tp_replicated_parameter_patterns"
_AVERAGE = "parameter_to_average_patterns"
_ROW = "parameter_with_row_parallelism_patterns"
_VOCAB = "vocabulary_parameter_patterns"
_TWO_SUB = "parameter_with_2_sub_params_cat_dim_0"
_SUB = "parameter_with_sub_params"
_SUB_WIDTHS = "sub_param_shard_widths"
_UNSUPPORTED = "autotp_unsupported_parameter_patterns"
_AFFINE = "affine_map"


def _patterns(record: Mapping[str, Any], key: str) -> list[str]:
    v = record.get(key) or []
    return [str(p) for p in v] if isinstance(v, (list, tuple)) else []


def _match(patterns: Sequence[str], name: str) -> str | None:
    return next((p for p in patterns if re.match(p, name)), None)


def tp_layout_from_record(record: Mapping[str, Any] | None,
                          name_to_rank_shapes: Mapping[str, Sequence[tuple[int, ...]]], *, where: str,
                          buffers: frozenset[str] = frozenset()) -> TpLayout:
    """The :class:`TpLayout` of a TP checkpoint from its ``universal_checkpoint_info`` ``record`` and each param's
    local shape on every TP rank. ``buffers`` are replicated on every rank unless the record says otherwise.

    Raises :class:`~dsckpt.errors.UnsupportedCheckpointError` (one message listing every offending param) when the
    record is missing, does not cover a param (AutoTP: no ``affine_map`` entry), asks for averaging, marks a param
    unsupported, or disagrees with the shapes."""
    names = list(name_to_rank_shapes)
    tp = len(next(iter(name_to_rank_shapes.values()))) if name_to_rank_shapes else 1
    if not isinstance(record, Mapping):
        raise UnsupportedCheckpointError(
            f"{where}: saved with tensor parallelism {tp} but without a 'universal_checkpoint_info' record saying how "
            f"each param is split (params: {_list(names)}); dsckpt does not guess splits from shapes. Save with "
            "DeepSpeed AutoTP, or pass the record in client_state as Megatron-DeepSpeed does")
    affine = record.get(_AFFINE)
    affine_params = affine.get("params") if isinstance(affine, Mapping) else None
    source = "autotp" if isinstance(affine_params, Mapping) else "megatron"
    replicated, average, row, vocab, two_sub = (_patterns(record, k) for k in (_REPLICATED, _AVERAGE, _ROW, _VOCAB,
                                                                                _TWO_SUB))
    subs = [s for s in (record.get(_SUB) or []) if isinstance(s, Mapping)]
    widths = record.get(_SUB_WIDTHS) or {}
    unsupported = record.get(_UNSUPPORTED) or {}
    orig_vocab = record.get("original_vocab_size")
    padded_vocab = record.get("padded_vocab_size")
    problems: list[str] = []
    cuts: dict[str, ParamCut] = {}
    for name, shapes in name_to_rank_shapes.items():
        shapes = [tuple(int(x) for x in s) for s in shapes]
        is_buffer = name in buffers
        if (p := _match(list(unsupported), name)) is not None:
            problems.append(f"'{name}' is marked unsupported by AutoTP ({unsupported[p]})")
            continue
        if affine_params is not None and not is_buffer and _match(list(affine_params), name) is None \
                and _match(replicated, name) is None:
            problems.append(f"'{name}' has no affine_map entry")
            continue
        try:
            cut = _cut(name, shapes, is_buffer, replicated, average, row, vocab, two_sub, subs, widths, orig_vocab,
                       padded_vocab)
        except ValueError as e:
            problems.append(str(e))
            continue
        if affine_params is not None and (p := _match(list(affine_params), name)) is not None:
            why = affine_disagreement(cut, affine_params[p])
            if why is not None:
                problems.append(f"'{name}': {why}")
                continue
        cuts[name] = cut
    if problems:
        raise UnsupportedCheckpointError(
            f"{where}: the tensor-parallel record (universal_checkpoint_info) does not say how to rebuild "
            f"{len(problems)} param(s): {first_of(problems, 6, '; ')}"
            "; dsckpt does not guess splits from shapes, so nothing was read")
    return TpLayout(tp, source, cuts)


def affine_disagreement(cut: ParamCut, entry: Any) -> str | None:
    """Why AutoTP's ``affine_map`` entry for a param disagrees with ``cut`` (derived from the category patterns),
    or None. The map's pieces say ``full.flatten().as_strided(shape, src_strides, src_offset) ==
    shard.flatten().as_strided(shape, dst_strides, dst_offset)`` (deepspeed/checkpoint/affine.py, 0.19.8); each
    piece is affine, so its corner elements, its element count and each rank's shard shape pin it against the
    piecewise-affine :meth:`ParamCut.rank_blocks` (a full element-by-element check would cost O(numel))."""
    try:
        logical = tuple(int(x) for x in entry["logical_shape"])
        if logical != cut.full_shape:
            return f"the category patterns give full shape {list(cut.full_shape)}, its affine_map says {list(logical)}"
        ranks = entry["ranks"]
        for t in range(cut.tp_size):
            spec = ranks[t] if t in ranks else ranks[str(t)]
            if tuple(int(x) for x in spec["shard_shape"]) != cut.rank_shapes[t]:
                return f"TP rank {t} holds {list(cut.rank_shapes[t])}, its affine_map says {list(spec['shard_shape'])}"
            blocks = cut.rank_blocks(t)
            covered = 0
            for pc in spec["pieces"]:
                if pc.get("scale") not in (None, 1, 1.0):
                    return "its affine_map scales a piece, which dsckpt does not read"
                shape = [int(x) for x in pc["shape"]]
                (src_off, src_strides), (dst_off, dst_strides) = pc["source"], pc["dest"]
                covered += math.prod(shape)
                for corner in itertools.product(*[(0, n - 1) if n > 1 else (0,) for n in shape]):
                    local = int(dst_off) + sum(i * int(s) for i, s in zip(corner, dst_strides))
                    full = int(src_off) + sum(i * int(s) for i, s in zip(corner, src_strides))
                    b = next((b for b in blocks if b.local_offset <= local < b.local_offset + b.numel), None)
                    mine = b.full_index(local - b.local_offset) if b is not None else None
                    if mine != full:
                        return (f"TP rank {t}'s local element {local} goes to full element {full} by its affine_map, "
                                f"to {mine} by the category patterns")
            if covered != sum(b.numel for b in blocks):
                return (f"TP rank {t}'s affine_map pieces cover {covered} elements, the category patterns "
                        f"{sum(b.numel for b in blocks)}")
    except (KeyError, TypeError, ValueError, IndexError):
        return "its affine_map entry is malformed (no logical_shape / ranks / pieces as DeepSpeed 0.19.8 writes them)"
    return None


def _list(names: Sequence[str]) -> str:
    return first_of(names, 5)


def _cut(name: str, shapes: list[tuple[int, ...]], is_buffer: bool, replicated: list[str], average: list[str],
         row: list[str], vocab: list[str], two_sub: list[str], subs: list[Mapping[str, Any]],
         widths: Mapping[str, Any], orig_vocab: Any, padded_vocab: Any) -> ParamCut:
    """One param's cut by ``merge_tp_slices``'s precedence: replicated, average, 2 sub-params, sub-params, row,
    else dim 0; then the vocabulary cut. Raises ValueError with a one-line reason."""
    tp = len(shapes)
    ranks = tuple(shapes)
    if _match(replicated, name) is not None or (is_buffer and not any(
            _match(ps, name) for ps in (row, vocab, two_sub))):
        if len(set(shapes)) != 1:
            raise ValueError(f"'{name}' is replicated but its TP ranks hold shapes {shapes}")
        return ParamCut(name, SplitKind.REPLICATED, None, shapes[0], ranks, category=_REPLICATED)
    if _match(average, name) is not None:
        raise ValueError(f"'{name}' is averaged across TP ranks (parameter_to_average_patterns), which has no exact "
                         "element source")
    sub = next((s for s in subs if _match([str(p) for p in s.get("patterns") or []], name)), None)
    category: str | None = None
    if _match(two_sub, name) is not None:
        category = _TWO_SUB
        dim = 0
        if any(s[0] % 2 for s in shapes):
            raise ValueError(f"'{name}' has 2 sub-params on dim 0 but a TP rank holds an odd row count {shapes}")
        sub_widths = tuple(tuple(s[0] // 2 for s in shapes) for _ in range(2))
        kind = SplitKind.SUB_PARAMS
    elif sub is not None:
        category = _SUB
        dim = int(sub.get("partition_dim", 0))
        pat = _match([str(p) for p in widths], name)
        w = widths.get(pat) if pat is not None else None
        if not isinstance(w, (list, tuple)) or not all(isinstance(x, (list, tuple)) and len(x) == tp for x in w):
            raise ValueError(f"'{name}' has sub-params but no sub_param_shard_widths with one width per TP rank")
        sub_widths = tuple(tuple(int(v) for v in x) for x in w)
        kind = SplitKind.SUB_PARAMS
    else:
        dim = 1 if _match(row, name) is not None else 0
        category = _ROW if dim == 1 else None
        sub_widths = (tuple(s[dim] if len(s) > dim else -1 for s in shapes),)
        kind = SplitKind.ROW if dim == 1 else SplitKind.COLUMN
    if any(len(s) <= dim for s in shapes):
        raise ValueError(f"'{name}' is split on dim {dim} but has shape {list(shapes[0])}")
    others = {s[:dim] + s[dim + 1:] for s in shapes}
    if len(others) != 1:
        raise ValueError(f"'{name}': TP ranks' shapes {shapes} differ outside the split dim {dim}")
    for t, s in enumerate(shapes):
        if sum(ws[t] for ws in sub_widths) != s[dim] or any(ws[t] < 0 for ws in sub_widths):
            raise ValueError(f"'{name}': sub-param widths {[list(w) for w in sub_widths]} do not add up to TP rank "
                             f"{t}'s {s[dim]} on dim {dim}")
    full_d = sum(s[dim] for s in shapes)
    keep: int | None = None
    if _match(vocab, name) is not None:
        if dim != 0 or kind is SplitKind.SUB_PARAMS:
            raise ValueError(f"'{name}' is a vocabulary param but not a plain dim-0 split")
        if not isinstance(orig_vocab, int) or not 0 < orig_vocab <= full_d:
            raise ValueError(f"'{name}' is a vocabulary param but original_vocab_size {orig_vocab!r} does not fit its "
                             f"{full_d} rows")
        if isinstance(padded_vocab, int) and padded_vocab != full_d:
            raise ValueError(f"'{name}': TP ranks hold {full_d} rows, padded_vocab_size says {padded_vocab}")
        keep = orig_vocab
        kind = SplitKind.VOCABULARY
        category = _VOCAB
    full_shape = list(shapes[0])
    full_shape[dim] = keep if keep is not None else full_d
    return ParamCut(name, kind, dim, tuple(full_shape), ranks, sub_widths, keep, category,
                    sub if category == _SUB else None)


# --------------------------------------------------------------------------------------------
# The writers' direction: one TP rank's local slices, as an ordinary (TP 1) logical checkpoint


def rank_view(ckpt: LogicalCheckpoint, layout: TpLayout, t: int) -> LogicalCheckpoint:
    """TP rank ``t`` of ``layout`` as an ordinary data-parallel logical checkpoint of its *local* slices: each
    entry has the local shape ``layout`` gives rank ``t``, and its stored copies' fragments (in local coordinates)
    name the source byte ranges the slice comes from, found through :meth:`ParamCut.rank_blocks` -- the inverse of
    :func:`compose`. The ZeRO writers then plan rank ``t``'s files from it like from any other checkpoint. Pure.

    A replicated param (and a buffer) takes the copy of source TP rank ``t`` (rank 0's where the source has fewer
    TP ranks); its files (model states, optimizer files) are that source rank's. Vocabulary padding rows (local
    elements :meth:`ParamCut.padding_blocks` places past the kept rows) take their values from the entry's
    padding pieces (:attr:`~dsckpt.model.TensorEntry.padding`), so a reshard that keeps the padded vocabulary
    carries them bit for bit; at another TP size of a Megatron-style record (:func:`megatron_layout`) they are
    zeros (:data:`~dsckpt.model.ZERO_FILL` fragments) in every stored copy, and the source's padding rows are left
    behind -- what ds_to_universal and DeepSpeed's universal loader do (``load_hp_checkpoint_state`` pads the
    vocabulary with zeros). Refused (:class:`~dsckpt.errors.UnsupportedCheckpointError`) where ``layout`` keeps
    the TP size but pads to another row count than the source, or the source lacks a copy's padding values that the
    same TP size would carry (a universal checkpoint: ds_to_universal cut them)."""
    src_tp = max(1, ckpt.tp_world_size)
    s = t if t < src_tp else 0
    # another TP size re-pads a vocabulary with zeros (as DeepSpeed's universal loader does); the same one keeps it
    repad = layout.tp_size != src_tp and layout.source == "megatron"
    other_size = [f"{e.name} ({e.shape[0] + e.padding_rows} rows, "
                  f"{e.shape[0] + layout.name_to_cut[e.name].padding_rows} at the target)" for e in ckpt.entries
                  if e.tied_to is None and layout.name_to_cut[e.name].padding_rows != e.padding_rows]
    if other_size and not repad:
        raise UnsupportedCheckpointError(
            f"cannot write TP rank {t} of '{ckpt.tag_dir}': the target pads the vocabulary of {_list(other_size)} "
            "differently from the source, whose padding rows dsckpt would have to invent; keep the TP size, or write "
            "--universal and load it with DeepSpeed's universal loader, which pads for the new model")
    entries: dict[str, TensorEntry] = {}
    no_padding: list[str] = []
    for e in ckpt.entries:
        if e.tied_to is not None:
            continue
        cut = layout.name_to_cut[e.name]
        if cut.kind is SplitKind.REPLICATED or cut.dim is None:
            pieces = _replicas_of(e.pieces, s, src_tp)
        else:
            blocks, pad_blocks = cut.rank_blocks(t), cut.padding_blocks(t)
            out_pieces = []
            for p in e.pieces:
                if p.same_as is not None:
                    continue
                frags = _local_fragments(p, blocks, e.name)
                if pad_blocks and repad:
                    frags += tuple(Fragment(ZERO_FILL, (), 0, b.numel, b.local_offset) for b in pad_blocks)
                elif pad_blocks:
                    pad = e.padding_of(p)
                    if pad is None:
                        no_padding.append(f"{e.name} ({p.label})")
                        continue
                    frags += _local_fragments(pad, pad_blocks, f"{e.name} (vocabulary padding rows)")
                out_pieces.append(Piece(p.role, p.dtype, frags, p.replica, state_key=p.state_key))
            pieces = tuple(out_pieces)
        entries[e.name] = dataclasses.replace(e, shape=cut.rank_shapes[t], pieces=pieces, padding=(), padding_rows=0)
    if no_padding:
        raise UnsupportedCheckpointError(
            f"cannot write TP rank {t} of '{ckpt.tag_dir}': the source holds no values for the vocabulary padding rows "
            f"of {_list(no_padding)} (a universal checkpoint: ds_to_universal cuts them); load it with DeepSpeed's "
            "universal loader, which pads with zeros")
    out = []
    for e in ckpt.entries:
        if e.tied_to is not None:
            src = entries[e.tied_to]
            out.append(dataclasses.replace(src, name=e.name, tied_to=src.name))
        else:
            out.append(entries[e.name])
    mark = f"mp_rank_{s:02d}"
    return dataclasses.replace(ckpt, entries=tuple(out), tp_world_size=1, tensor_parallel=None,
                               files=tuple(f for f in ckpt.files if mark in f.name), notes=())


def _replicas_of(pieces: Sequence[Piece], s: int, tp: int) -> tuple[Piece, ...]:
    """Source TP rank ``s``'s copies of a replicated tensor, renumbered as that rank's reader numbered them
    (``combine_tp_ranks`` numbers rank ``s``'s copies ``s * stride + replica``)."""
    stride = (1 + max((p.replica for p in pieces), default=0)) // tp
    return tuple(dataclasses.replace(p, replica=p.replica - s * stride, same_as=None) for p in pieces
                 if s * stride <= p.replica < (s + 1) * stride)


def _local_fragments(piece: Piece, blocks: Sequence[TpBlock], name: str) -> tuple[Fragment, ...]:
    """The fragments of a local slice (local coordinates) whose elements land in the full tensor as ``blocks``
    say, found among ``piece``'s fragments (full coordinates, possibly strided); sorted by local offset,
    consecutive contiguous ones merged.

    Each (block, fragment) pair is intersected in closed form (:func:`_intersect`), never run by run where the
    two share their stride: a row-parallel slice whose source runs are the target's (TP size kept) becomes one
    contiguous local fragment, source runs inside longer target runs (TP merged) one fragment strided in local
    coordinates, and a target run taking part of each source run (TP split, or a TP-1 source cut) one fragment
    strided in the source (``src_stride``). Cost O(blocks x fragments) plus the fragments emitted, not O(rows)."""
    strided = [f for f in piece.fragments if f.strided]
    assert not any(f.src_strided for f in strided), "a reader's fragments are contiguous in their files"
    flat = sorted((f for f in piece.fragments if not f.strided), key=lambda f: f.dst_offset)
    starts = [f.dst_offset for f in flat]
    out: list[Fragment] = []
    for b in blocks:
        r = b.run_numel if b.run_numel and b.run_numel < b.numel else 0
        rows = b.numel // r if r else 1
        lo = b.full_offset
        hi = b.full_offset + ((rows - 1) * b.full_stride + r if r else b.numel)  # the block's full span
        covered = 0
        for f in strided:
            if f.dst_offset < hi and f.dst_index(f.numel - 1) >= lo:
                covered += _intersect(f, b, out)
        i = max(0, bisect.bisect_right(starts, lo) - 1)
        while i < len(flat) and flat[i].dst_offset < hi:
            if flat[i].dst_offset + flat[i].numel > lo:
                covered += _intersect(flat[i], b, out)
            i += 1
        if covered != b.numel:
            raise CorruptCheckpointError(
                f"tensor '{name}': its {piece.label} copy covers {covered} of the {b.numel} full elements "
                f"{'in runs of ' + str(r) + ' from ' if r else 'at '}[{lo}, {hi}); the checkpoint's fragments are "
                "incomplete")
    out.sort(key=lambda f: f.dst_offset)
    merged: list[Fragment] = []
    for g in out:
        last = merged[-1] if merged else None
        if (last is not None and not last.strided and not g.strided
                and (last.file, last.key, last.rank) == (g.file, g.key, g.rank)
                and last.src_offset + last.numel == g.src_offset and last.dst_offset + last.numel == g.dst_offset):
            merged[-1] = Fragment(last.file, last.key, last.src_offset, last.numel + g.numel, last.dst_offset,
                                  last.rank)
        else:
            merged.append(g)
    return tuple(merged)


def _intersect(f: Fragment, b: TpBlock, out: list[Fragment]) -> int:
    """Append to ``out`` the local fragments of the elements both ``f`` (full coordinates) and ``b`` cover, and
    return how many there are. Both are sets of equal runs at a fixed stride (one run when contiguous); where
    they share the stride (or one has one run) and no run is longer than it, source run ``j`` meets the block's
    row ``j + q + k`` (k = 0, 1: a source run may reach into the next row's period) in one window ``[a, e)``
    of that row, the same for every row, so each window is one fragment: contiguous when it holds whole source
    and block runs, strided in local coordinates when whole source runs only, strided in the source otherwise.
    A contiguous source longer than a block row holds some rows whole (one fragment strided in the source) and
    cuts at most two. Otherwise one side is cut into its runs first (a source run against the block)."""
    fr, fs, fm = (f.run_numel, f.dst_stride, f.numel // f.run_numel) if f.strided else (f.numel, 0, 1)
    br, bs, bn = ((b.run_numel, b.full_stride, b.numel // b.run_numel) if b.run_numel and b.run_numel < b.numel
                  else (b.numel, 0, 1))
    D, F = f.dst_offset, b.full_offset
    if fm == 1 and bn == 1:
        lo, hi = max(D, F), min(D + fr, F + br)
        if lo >= hi:
            return 0
        out.append(Fragment(f.file, f.key, f.src_offset + lo - D, hi - lo, b.local_offset + lo - F, f.rank))
        return hi - lo
    S = fs if fm > 1 else bs
    if (fm > 1 and bn > 1 and fs != bs) or fr > S or br > S:
        covered = 0
        if fm > 1:  # each source run against the block
            for j in runs_overlapping(D, fr, fs, fm, F, F + (bn - 1) * bs + br):
                covered += _intersect(Fragment(f.file, f.key, f.src_offset + j * fr, fr, D + j * fs, f.rank), b, out)
        else:  # a contiguous source longer than a block row: the rows it holds whole, then the (two) it cuts
            rows = runs_overlapping(F, br, bs, bn, D, D + fr)
            i0 = min(max(rows.start, -(-(D - F) // bs)), rows.stop)
            i1 = max(min(rows.stop, (D + fr - F - br) // bs + 1), i0)
            if i0 < i1:
                src, local, n = f.src_offset + F + i0 * bs - D, b.local_offset + i0 * br, (i1 - i0) * br
                out.append(Fragment(f.file, f.key, src, n, local, f.rank, run_numel=br, dst_stride=br, src_stride=bs)
                           if i1 - i0 > 1 and bs != br else Fragment(f.file, f.key, src, n, local, f.rank))
                covered += n
            for i in (*range(rows.start, i0), *range(i1, rows.stop)):
                covered += _intersect(f, TpBlock(b.local_offset + i * br, br, F + i * bs), out)
        return covered
    q, c = divmod(D - F, S)  # source run j starts at column c of the block's row period j + q
    covered = 0
    for k in (0, 1):
        a, e = max(c - k * S, 0), min(c - k * S + fr, br)
        j0, j1 = max(0, -(q + k)), min(fm, bn - q - k)
        if a >= e or j0 >= j1:
            continue
        w, n = e - a, j1 - j0
        src = f.src_offset + j0 * fr + a - (c - k * S)
        local = b.local_offset + (j0 + q + k) * br + a
        if n == 1 or w == fr == br:
            out.append(Fragment(f.file, f.key, src, n * w, local, f.rank))
        elif w == fr:
            out.append(Fragment(f.file, f.key, src, n * w, local, f.rank, run_numel=w, dst_stride=br))
        else:  # part of each source run (TP split): strided in the source, in runs of w
            out.append(Fragment(f.file, f.key, src, n * w, local, f.rank, run_numel=w, dst_stride=br, src_stride=fr))
        covered += n * w
    return covered


def resize_layout(layout: TpLayout, tp_size: int, *, meta: Any = None, vocab_divisor: int | None = None) -> TpLayout:
    """``layout`` at another TP size: the same params cut for ``tp_size`` ranks. Pure.

    A Megatron-style record (:func:`megatron_layout`) splits evenly, its vocabulary padded by ``vocab_divisor``
    (Megatron's ``make_vocab_size_divisible_by``). An AutoTP one: TP 1 (every param whole on one rank) is always
    possible; another size takes the widths DeepSpeed's AutoTP would choose there
    (:func:`dsckpt.autotp_widths.target_layout`, proven on the source's widths first), which needs ``meta``
    (:class:`~dsckpt.autotp_widths.AutoTpMeta`, from the model's config.json); refused otherwise."""
    if tp_size == layout.tp_size:
        return layout
    if layout.source == "megatron":
        return megatron_layout(layout, tp_size, vocab_divisor)
    padded = [n for n, c in layout.name_to_cut.items() if c.padding_rows]
    if padded:
        raise UnsupportedCheckpointError(
            f"{_list(padded)} hold padding rows past the original vocabulary size, which a model at another TP size "
            "pads to a size only the model knows; changing the TP size of a padded vocabulary of an AutoTP record is "
            "not supported: write --universal and load it with \"checkpoint\": {\"load_universal\": true} (DeepSpeed "
            "re-pads the vocabulary with zeros for the new model)")
    if tp_size != 1:
        return target_layout(layout, tp_size, meta)
    cuts = {}
    for name, c in layout.name_to_cut.items():
        widths = tuple((sum(ws),) for ws in c.sub_widths)
        if c.dim is None or c.kind is SplitKind.REPLICATED:
            cuts[name] = dataclasses.replace(c, rank_shapes=(c.full_shape,))
        else:
            cuts[name] = dataclasses.replace(c, rank_shapes=(c.full_shape,), sub_widths=widths)
    return TpLayout(1, layout.source, cuts)


def padded_vocab_size(vocab_size: int, divisor: int, tp_size: int) -> int:
    """Megatron's ``_vocab_size_with_padding``: ``vocab_size`` rounded up to a multiple of ``divisor * tp_size``."""
    multiple = divisor * tp_size
    return -(-vocab_size // multiple) * multiple


def megatron_layout(layout: TpLayout, tp_size: int, vocab_divisor: int | None) -> TpLayout:
    """A Megatron-style record's ``layout`` cut for ``tp_size`` ranks the way Megatron's layers (and DeepSpeed's
    universal loader, ``torch.chunk``) cut it: every split dim, and each sub-param of a fused param, in ``tp_size``
    equal parts; a vocabulary padded to ``padded_vocab_size(original, vocab_divisor, tp_size)`` rows, at TP 1 too (the
    TP-1 files keep the record, :func:`megatron_record_at`, which says the padding rows are padding:
    :func:`dsckpt.readers.tensor_parallel.with_tp1_record`). Pure.

    Proven first on the source: its TP ranks must hold the equal parts of each split (and ``vocab_divisor`` must give
    the source's padded row count at the source's TP size). Raises
    :class:`~dsckpt.errors.UnsupportedCheckpointError` naming every param that cannot be cut so (a split dim that
    does not divide by ``tp_size``, uneven source widths, fused sub-params with recorded shard widths at TP > 1) or
    a vocabulary that needs ``vocab_divisor`` without one; :class:`~dsckpt.errors.UsageError` for a
    ``vocab_divisor`` that does not give the source's padded size."""
    src = layout.tp_size
    vocab = {n: c for n, c in layout.name_to_cut.items() if c.keep_rows is not None}
    target_rows: int | None = None
    if vocab:
        orig = next(iter(vocab.values())).keep_rows
        src_rows = layout.vocab_rows
        assert orig is not None
        padded = any(c.padding_rows for c in vocab.values())
        if vocab_divisor is None and (padded or orig % tp_size):
            was = f", padded to {max(src_rows)} at TP {src}" if padded else ""
            raise UnsupportedCheckpointError(
                f"changing the tensor-parallel size from {src} to {tp_size} re-pads the vocabulary of "
                f"{_list(list(vocab))} ({orig} rows{was}): Megatron pads it to a multiple of "
                "make_vocab_size_divisible_by x TP, which the checkpoint does not record; pass "
                "--make-vocab-size-divisible-by with the value the model trains with")
        if vocab_divisor is not None:
            if not isinstance(vocab_divisor, int) or vocab_divisor < 1:
                raise UsageError(f"--make-vocab-size-divisible-by must be a positive integer, got {vocab_divisor!r}")
            at_source = padded_vocab_size(orig, vocab_divisor, src)
            if src_rows != {at_source}:
                raise UsageError(
                    f"--make-vocab-size-divisible-by {vocab_divisor} pads the {orig}-row vocabulary to {at_source} "
                    f"rows at the source's TP size {src}, but {_list(list(vocab))} hold {sorted(src_rows)[0]}: it is "
                    "not the value this model was trained with")
            target_rows = padded_vocab_size(orig, vocab_divisor, tp_size)
        else:
            target_rows = orig
    problems: list[str] = []
    cuts: dict[str, ParamCut] = {}
    for name, c in layout.name_to_cut.items():
        if c.dim is None or c.kind is SplitKind.REPLICATED:
            cuts[name] = dataclasses.replace(c, rank_shapes=(c.full_shape,) * tp_size)
            continue
        if c.category == _SUB and tp_size > 1:
            problems.append(f"'{name}' is a fused param with recorded sub_param_shard_widths (the training code's own "
                            "cut)")
            continue
        totals = [sum(ws) for ws in c.sub_widths]
        if c.keep_rows is not None:
            assert target_rows is not None
            totals = [target_rows]
        uneven = [ws for ws in c.sub_widths if len(set(ws)) != 1]
        if uneven:
            problems.append(f"'{name}': its TP ranks hold uneven widths {list(uneven[0])} on dim {c.dim}, not "
                            "Megatron's equal parts")
            continue
        if tp_size > 1 and any(n % tp_size for n in totals):
            problems.append(f"'{name}': {' + '.join(map(str, totals))} on dim {c.dim} "
                            f"{'do' if len(totals) > 1 else 'does'} not split into {tp_size} equal parts")
            continue
        widths = tuple((n // tp_size,) * tp_size for n in totals)
        local = list(c.full_shape)
        local[c.dim] = sum(w[0] for w in widths)
        cuts[name] = dataclasses.replace(c, rank_shapes=(tuple(local),) * tp_size, sub_widths=widths)
    if problems:
        raise UnsupportedCheckpointError(
            f"changing the tensor-parallel size of a Megatron-style TP record from {src} to {tp_size} is not "
            f"supported for {len(problems)} param(s): {first_of(problems, 6, '; ')}")
    return TpLayout(tp_size, layout.source, cuts)


def megatron_record_at(record: Mapping[str, Any], target: TpLayout) -> dict[str, Any]:
    """The Megatron-style ``universal_checkpoint_info`` at ``target``'s TP size (TP 1 included, where
    Megatron-DeepSpeed saves it too): the patterns unchanged, ``padded_vocab_size`` the target's padded row count,
    ``sub_param_shard_widths`` the target's widths of each sub-param (one per TP rank: the readers take them as the
    cut, :func:`tp_layout_from_record`). Pure."""
    out = dict(record)
    rows = target.vocab_rows
    if "padded_vocab_size" in out and rows:
        (out["padded_vocab_size"],) = rows
    widths = out.get(_SUB_WIDTHS)
    if isinstance(widths, Mapping):
        subs = [c for c in target.name_to_cut.values() if c.category == _SUB]
        out[_SUB_WIDTHS] = {p: next(([list(ws) for ws in c.sub_widths] for c in subs if re.match(str(p), c.name)), w)
                            for p, w in widths.items()}
    return out


def megatron_note(source: Any, target: Any) -> str:
    """What a TP size change of a Megatron-style record did, for the plan's notes."""
    vocab = [(n, c) for n, c in target.name_to_cut.items() if c.keep_rows is not None]
    split = sum(1 for c in target.name_to_cut.values() if c.dim is not None)
    note = (f"tensor parallelism {source.tp_size} -> {target.tp_size} (Megatron-style record): {split} split params "
            "cut in equal parts, as Megatron's layers and DeepSpeed's universal loader cut them")
    if vocab:
        name, c = vocab[0]
        rows = sum(c.sub_widths[0])
        note += (f"; vocabulary ({len(vocab)} params) of {c.keep_rows} rows padded to {rows} "
                 f"({rows - c.keep_rows} zero rows in every copy; the source's "
                 f"{source.name_to_cut[name].padding_rows} padding rows are not carried, as in ds_to_universal)")
    return note
