"""Tensor-parallel checkpoints (DeepSpeed AutoTP; Megatron-style models saved through DeepSpeed with an ``mpu``).

Each TP rank ``t`` is an ordinary stage-0, ZeRO-1/2/3 or ``BF16_Optimizer`` checkpoint of its local slices, in the files
named ``mp_rank_{t:02d}`` (tests/fixtures/README.md, "AutoTP fixtures"). This reader reads every TP rank with the
reader of its layout, parses the ``universal_checkpoint_info`` record of the model-states files into a
:class:`~dsckpt.parallel_layout.TpLayout`, and maps each rank's local fragments to fragments of the full tensor
(:func:`~dsckpt.tensor_parallel.compose`). Replicated params (and buffers) keep every TP rank's copy as a replica.
Commands then see one ordinary logical checkpoint of full tensors.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, IncompleteCheckpointError
from ..layout import CheckpointFiles
from ..model import Kind, LogicalCheckpoint, Piece, TensorEntry
from ..parallel_layout import ParamCut, SplitKind, TpLayout
from ..tensor_parallel import compose, tp_layout_from_record
from .common import FileCache, alias_entry

__all__ = ["UNIVERSAL_CHECKPOINT_INFO", "agreed_record", "combine_tp_ranks", "rank_files", "is_megatron_record",
           "read_tensor_parallel", "with_tp1_record"]

UNIVERSAL_CHECKPOINT_INFO = "universal_checkpoint_info"


def rank_files(files: CheckpointFiles, t: int) -> CheckpointFiles:
    """TP rank ``t``'s files, renumbered as model-parallel rank 0 (the per-rank readers see one DP checkpoint)."""
    return dataclasses.replace(
        files,
        mp_to_model_states={0: files.mp_to_model_states[t]} if t in files.mp_to_model_states else {},
        dp_mp_to_zero3_model_states={(d, 0): p for (d, mp), p in files.dp_mp_to_zero3_model_states.items() if mp == t},
        dp_mp_to_optim_states={(d, 0): p for (d, mp), p in files.dp_mp_to_optim_states.items() if mp == t},
    )


def read_tensor_parallel(files: CheckpointFiles, cache: FileCache, tp_size: int) -> LogicalCheckpoint:
    from .stage0 import read_stage0
    from .zero3 import read_zero3
    from .zero12 import read_zero12

    zero3 = bool(files.dp_mp_to_zero3_model_states)
    missing = [t for t in range(tp_size) if not (
        any(mp == t for _, mp in files.dp_mp_to_zero3_model_states) if zero3 else t in files.mp_to_model_states)]
    if missing:
        raise IncompleteCheckpointError(
            f"'{files.tag_dir}' was saved with tensor parallelism {tp_size} but has no model-states file for TP "
            f"rank(s) {missing}; the save was probably interrupted; pick another tag with --tag")
    # Without ZeRO (stage 0) there are no optimizer files: each TP rank's mp_rank_{t} model-states file holds its
    # module slices and its optimizer (torch's, or the 16-bit wrapper's masters), read as a dense stage-0 save.
    stage0 = not zero3 and not files.dp_mp_to_optim_states
    no_optim = [t for t in range(tp_size) if not any(mp == t for _, mp in files.dp_mp_to_optim_states)]
    if no_optim and not stage0:
        raise IncompleteCheckpointError(
            f"'{files.tag_dir}' was saved with tensor parallelism {tp_size} but has no optimizer-state files for TP "
            f"rank(s) {no_optim} (no '*_mp_rank_{no_optim[0]:02d}_optim_states.pt'); the save was probably "
            "interrupted or files of another run were added; pick another tag with --tag")
    reader: Callable[[CheckpointFiles, FileCache], LogicalCheckpoint] = (
        read_zero3 if zero3 else read_stage0 if stage0 else read_zero12)
    ranks = [reader(rank_files(files, t), cache) for t in range(tp_size)]
    record_path = files.dp_mp_to_zero3_model_states[(0, 0)] if zero3 else files.mp_to_model_states[0]
    record = cache.tree(record_path).get(UNIVERSAL_CHECKPOINT_INFO)
    for t in range(1, tp_size):
        other = files.mp_to_model_states.get(t) if not zero3 else files.dp_mp_to_zero3_model_states.get((0, t))
        if other is not None and cache.tree(other).get(UNIVERSAL_CHECKPOINT_INFO) != record:
            raise CorruptCheckpointError(
                f"{other}: its {UNIVERSAL_CHECKPOINT_INFO} differs from {record_path.name}'s; the TP ranks' files "
                "come from different runs")
    ckpt = combine_tp_ranks(ranks, record if isinstance(record, Mapping) else None, where=str(record_path))
    return dataclasses.replace(ckpt, files=tuple(files.all_files()))


def combine_tp_ranks(ranks: list[LogicalCheckpoint], record: Mapping[str, Any] | None, *,
                     where: str) -> LogicalCheckpoint:
    """One logical checkpoint of full tensors from the TP ranks' logical checkpoints of local slices."""
    first = ranks[0]
    for t, r in enumerate(ranks[1:], start=1):
        if r.layout != first.layout:
            raise CorruptCheckpointError(f"'{first.tag_dir}': TP rank {t} is {r.layout}, TP rank 0 is {first.layout}; "
                                         "the files come from different runs")
    entries, layout = combine_entries([{e.name: e for e in r.entries} for r in ranks], record, where=where)
    tp = len(ranks)
    split = sum(1 for c in layout.name_to_cut.values() if c.kind is not SplitKind.REPLICATED)
    note = (f"tensor parallelism {tp} ({'AutoTP affine map' if layout.source == 'autotp' else 'Megatron-style record'}"
            f" in {UNIVERSAL_CHECKPOINT_INFO}): {split} tensors split, "
            f"{len(layout.name_to_cut) - split} replicated on every TP rank")
    return dataclasses.replace(
        first, entries=tuple(entries[e.name] for e in first.entries), tp_world_size=tp, tensor_parallel=layout,
        files=tuple(sorted({f for r in ranks for f in r.files})),
        notes=(*dict.fromkeys(n for r in ranks for n in r.notes), note),
    )


def combine_entries(per_rank: list[dict[str, TensorEntry]], record: Mapping[str, Any] | None, *,
                    where: str) -> tuple[dict[str, TensorEntry], TpLayout]:
    """Full-tensor entries (in TP rank 0's order) from every TP rank's entries of local slices, and the layout
    that maps them. Tied aliases follow their source."""
    names = list(per_rank[0])
    for t, r in enumerate(per_rank[1:], start=1):
        if list(r) != names:
            extra = sorted(set(r) ^ set(names))
            raise CorruptCheckpointError(
                f"{where}: TP rank {t} holds other tensors than TP rank 0"
                + (f" ({', '.join(extra[:5])})" if extra else " (in another order)") + "; the files come from "
                "different runs")
    own = [e for e in per_rank[0].values() if e.tied_to is None]
    shapes = {e.name: [r[e.name].shape for r in per_rank] for e in own}
    buffers = frozenset(e.name for e in own if e.kind is Kind.BUFFER)
    layout = tp_layout_from_record(record, shapes, where=where, buffers=buffers)
    entries: dict[str, TensorEntry] = {}
    for e in own:
        entries[e.name] = _combine(e.name, [r[e.name] for r in per_rank], layout.name_to_cut[e.name])
    out = {}
    for name, e in per_rank[0].items():
        out[name] = alias_entry(name, entries[e.tied_to]) if e.tied_to is not None else entries[name]
    return out, layout


def _combine(name: str, per_rank: list[TensorEntry], cut: ParamCut) -> TensorEntry:
    e0 = per_rank[0]
    for t, e in enumerate(per_rank[1:], start=1):
        if e.kind is not e0.kind or e.trainable != e0.trainable:
            raise CorruptCheckpointError(f"tensor '{name}': TP rank {t} stores it as {e.kind.value}"
                                         f"{'' if e.trainable else ' (frozen)'}, TP rank 0 does not")
    pieces: list[Piece] = []
    padding: list[Piece] = []
    if cut.kind is SplitKind.REPLICATED:
        stride = 1 + max((p.replica for e in per_rank for p in e.pieces), default=0)
        for t, e in enumerate(per_rank):
            pieces += [dataclasses.replace(p, replica=t * stride + p.replica, same_as=p.replica if t else p.same_as)
                       for p in e.pieces]
    else:
        for p0 in e0.pieces:
            frags, pad_frags = [], []
            for t, e in enumerate(per_rank):
                p = next((q for q in e.pieces if q.same_copy(p0)), None)
                if p is None or p.dtype != p0.dtype:
                    raise CorruptCheckpointError(
                        f"tensor '{name}': TP rank {t} has no {p0.dtype} {p0.label} copy (replica {p0.replica}), "
                        "TP rank 0 has; the files come from different runs")
                blocks, pad_blocks = cut.rank_blocks(t), cut.padding_blocks(t)
                frags += [g for f in p.fragments for g in compose(f, blocks)]
                pad_frags += [g for f in p.fragments for g in compose(f, pad_blocks)]
            pieces.append(dataclasses.replace(p0, fragments=tuple(frags)))
            if cut.padding_rows:  # the vocabulary padding rows' values: kept apart from the tensor
                padding.append(dataclasses.replace(p0, fragments=tuple(pad_frags), same_as=None))
    return TensorEntry(name, cut.full_shape, e0.kind, e0.trainable, tuple(pieces), group=e0.group,
                       ambiguous=e0.ambiguous, padding=tuple(padding), padding_rows=cut.padding_rows)


def agreed_record(cache: FileCache, model_states: Sequence[Path]) -> tuple[Mapping[str, Any] | None, str]:
    """The ``universal_checkpoint_info`` record of the first of ``model_states`` (None if absent) and where it was
    found; refused when another file holds a different one (the files come from different runs)."""
    first = model_states[0]
    record = cache.tree(first).get(UNIVERSAL_CHECKPOINT_INFO)
    for other in model_states[1:]:
        if cache.tree(other).get(UNIVERSAL_CHECKPOINT_INFO) != record:
            raise CorruptCheckpointError(
                f"{other}: its {UNIVERSAL_CHECKPOINT_INFO} differs from {first.name}'s; the model-parallel ranks' "
                "files come from different runs")
    return (record if isinstance(record, Mapping) else None), str(first)


def with_tp1_record(ckpt: LogicalCheckpoint, cache: FileCache, model_states: Sequence[Path]) -> LogicalCheckpoint:
    """``ckpt`` (read without tensor parallelism) with the Megatron-style ``universal_checkpoint_info`` record its
    ``model_states`` files carry, if any, applied at TP 1: a vocabulary padded past ``original_vocab_size`` reads as
    its original rows, the padding rows kept apart (:attr:`~dsckpt.model.TensorEntry.padding`) as at TP > 1.

    Megatron-DeepSpeed saves the record at every TP size, TP 1 included (``megatron/checkpointing.py``:
    ``if args.deepspeed: state_dict[UNIVERSAL_CHECKPOINT_INFO] = _universal_checkpoint_info(model)``), and
    ``dsckpt reshard --tp-size 1`` of a Megatron-style record writes it too (:func:`dsckpt.tensor_parallel.
    megatron_record_at`). DeepSpeed AutoTP writes none at TP 1; an AutoTP record (an ``affine_map``) found there is
    left alone. Raises :class:`~dsckpt.errors.UnsupportedCheckpointError` where the record does not say how to read a
    param (:func:`~dsckpt.tensor_parallel.tp_layout_from_record`): its padding rows would otherwise read as
    vocabulary."""
    if not model_states:
        return ckpt
    record, where = agreed_record(cache, model_states)
    if not is_megatron_record(record):
        return ckpt
    entries, layout = combine_entries([{e.name: e for e in ckpt.entries}], record, where=where)
    vocab = [c for c in layout.name_to_cut.values() if c.padding_rows]
    note = (f"Megatron-style {UNIVERSAL_CHECKPOINT_INFO} at tensor parallelism 1: vocabulary of "
            f"{', '.join(c.name for c in vocab)} read as its {vocab[0].keep_rows} original rows, "
            f"{vocab[0].padding_rows} padding rows kept apart" if vocab else
            f"Megatron-style {UNIVERSAL_CHECKPOINT_INFO} at tensor parallelism 1: every param whole")
    return dataclasses.replace(ckpt, entries=tuple(entries[e.name] for e in ckpt.entries), tensor_parallel=layout,
                               notes=(*ckpt.notes, note))


def is_megatron_record(record: Any) -> bool:
    """Whether ``record`` (a ``universal_checkpoint_info`` value) is Megatron-style -- category patterns only -- and
    not DeepSpeed AutoTP's (an ``affine_map``) or AutoEP's copy of its layers (``ds_autoep_layers``)."""
    if not isinstance(record, Mapping) or record.get("ds_autoep_layers") is not None:
        return False
    affine = record.get("affine_map")
    return not (isinstance(affine, Mapping) and isinstance(affine.get("params"), Mapping))
