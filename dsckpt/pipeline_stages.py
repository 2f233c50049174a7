"""Pipeline stages at another stage count: the layer list rebuilt from the files, the boundaries ``PipelineModule``
computes for it, and each target stage as an ordinary data-parallel checkpoint of its params. Pure: no I/O.

A pipeline checkpoint (DeepSpeed 0.19.8, ``PipelineModule``) stores one ``layer_XX-model_states.pt`` per layer
that has a ``state_dict`` (named by the layer's global index, whatever its stage) and per stage ``s`` a
``mp_rank_{s:02d}_model_states.pt`` and ZeRO-1 / ``BF16_Optimizer`` files ``*_mp_rank_{s:02d}_optim_states.pt``
partitioning that stage's params. The layer files are the same for every stage count; the per-stage files are cut
by the stage boundaries ``parts``, which DeepSpeed does not save but recomputes at start-up from
``partition_method`` (pipe/module.py ``_partition_layers``). So the target's stage files are planned from the
boundaries the user's ``PipelineModule`` will compute (:func:`~dsckpt.parallel_layout.stage_parts`, DeepSpeed's
arithmetic), and the source's boundaries are first recomputed by the same method and checked against what the
files show (which stage's ``param_shapes`` lists each layer's params): a method that does not reproduce the
source is refused naming both.

What the files do not state and this module rebuilds: the layers without a file (functions, tied uses with a
``forward_fn``) -- their number is ``--num-layers`` (default: up to the last layer file) and each is either a function
(no params) or a use of a tied module; every reading consistent with the source is tried, and a target that depends
on which one holds is refused as ambiguous (bind, then prove). ``type:REGEX`` needs the layers' class names, which
no file stores (``layer_types``).
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Sequence

from .errors import UnsupportedCheckpointError, UsageError
from .model import Kind, LogicalCheckpoint, Role
from .parallel_layout import PipelineLayer, PipelineLayout, PipelineRecord, StagePlan, stage_parts

__all__ = ["StagePlan", "plan_stages", "stage_view"]

MAX_READINGS = 4096  # readings of the file-less layers tried before refusing (each costs one partition)


def plan_stages(ckpt: LogicalCheckpoint, pp_size: int | None = None, *, method: str | None = None,
                num_layers: int | None = None, layer_types: Sequence[str] | None = None) -> StagePlan:
    """The target's stages. ``pp_size`` None keeps the source's; another stage count needs ``method`` (the
    ``partition_method`` the run will load with, DeepSpeed's default ``parameters`` when None). Raises
    :class:`UsageError` for bad options and :class:`UnsupportedCheckpointError` where the method does not reproduce
    the source's stages or the target depends on what the files leave open."""
    record = ckpt.pipeline
    assert record is not None, "plan_stages is for pipeline checkpoints"
    src_pp = record.num_stages
    pp = src_pp if pp_size is None else pp_size
    if not isinstance(pp, int) or pp < 1:
        raise UsageError(f"--pp-size must be a positive integer, got {pp_size!r}")
    group_of = {n: g for order in record.stage_group_orders for g, names in enumerate(order) for n in names}
    buffers = [e.name for e in ckpt.entries if e.kind is Kind.BUFFER]
    if pp == src_pp and method is None:
        return StagePlan(record.stage_group_orders, tuple(range(src_pp)),
                         record.stage_buffers or tuple(() for _ in range(src_pp)), src_pp)
    method = method or "parameters"
    source, target = _layouts(ckpt, record, pp, method, num_layers, layer_types)
    n_groups = max((len(o) for o in record.stage_group_orders), default=0)
    orders = []
    empty = []
    for s in range(pp):
        names = target.stage_param_names(s)
        groups = tuple(tuple(n for n in names if group_of.get(n) == g) for g in range(n_groups))
        empty += [f"stage {s} group {g}" for g, names_g in enumerate(groups) if not names_g]
        orders.append(groups)
    if empty:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to {pp} pipeline stages: with partition_method '{method}' "
            f"({target.describe()}) {', '.join(empty)} would hold no trainable params, and DeepSpeed's ZeRO optimizer "
            "cannot hold an empty param group; pick fewer stages or another --partition-method")
    templates = tuple(source.stage_of_layer(target.parts[s]) if target.parts[s] < target.num_layers else src_pp - 1
                      for s in range(pp))
    stage_buffers = tuple(tuple(b for b in buffers if _layer_index(b) in range(target.parts[s], target.parts[s + 1]))
                          for s in range(pp))
    return StagePlan(tuple(orders), templates, stage_buffers, src_pp, source, target)


def _layer_index(name: str) -> int:
    head = name.split(".", 1)[0]
    return int(head) if head.isdigit() else -1


def _layouts(ckpt: LogicalCheckpoint, record: PipelineRecord, pp: int, method: str, num_layers: int | None,
             layer_types: Sequence[str] | None) -> tuple[PipelineLayout, PipelineLayout]:
    """The source's layout and the target's, from every reading of the file-less layers that reproduces the
    source's stages; refused when none does or when the target depends on the reading."""
    by_index = {layer.index: layer for layer in record.layers}
    last = max(by_index, default=-1) + 1
    if layer_types is not None:
        if num_layers is not None and num_layers != len(layer_types):
            raise UsageError(f"--num-layers {num_layers} and the {len(layer_types)} --layer-types disagree")
        num_layers = len(layer_types)
    n = last if num_layers is None else num_layers
    if n < last:
        raise UsageError(f"--num-layers {n} is less than the layers the checkpoint has files for "
                         f"(layer_{last - 1:02d})")
    if method.lower().startswith("type:") and layer_types is None:
        raise UsageError(f"partition method '{method}' matches layer class names, which no checkpoint file stores; "
                         "give them with --layer-types NAME,NAME,... (one per PipelineModule layer, in order)")
    free = [i for i in range(n) if i not in by_index]
    keys = [k for k, _, _ in record.tied]
    tied_by_key = {k: t for t in record.tied for k in (t[0],)}
    choices: list[list[tuple[str, tuple[str, ...], int] | None]]
    types: list[str] | None = None
    if layer_types is not None:  # the user's layer list: file-less layers are functions unless marked Name[key]
        types, marks = _parse_types(layer_types)
        unknown = sorted({k for k in marks if k is not None and k not in tied_by_key})
        wrong = [i for i in by_index if by_index[i].tied_key != marks[i] and marks[i] is not None]
        if unknown or wrong:
            raise UsageError("--layer-types: "
                             f"{'tied keys ' + str(unknown) + ' are not in the checkpoint' if unknown else ''}"
                             f"{'; ' if unknown and wrong else ''}"
                             f"{'layers ' + str(wrong) + ' are not uses of the tied module named' if wrong else ''}")
        choices = [[tied_by_key[marks[i]] if marks[i] is not None else None] for i in free]  # type: ignore[index]
    else:
        choices = [[None, *record.tied] for _ in free]
    if (len(keys) + 1) ** len(free) > MAX_READINGS and layer_types is None:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to {pp} pipeline stages: {len(free)} of its {n} layers have no file "
            f"and {len(keys)} tied modules could sit in them; too many readings to try. Give the layer list with "
            "--layer-types")
    src_pp = record.num_stages
    found: dict[tuple[object, ...], tuple[PipelineLayout, PipelineLayout]] = {}
    readings: dict[tuple[object, ...], str] = {}
    tried: list[str] = []
    for reading in itertools.product(*choices):
        layers = dict(by_index)
        for i, tied in zip(free, reading):
            layers[i] = (PipelineLayer(i, (), 0, None, False) if tied is None
                         else PipelineLayer(i, tied[1], tied[2], tied[0], False))
        table = tuple(layers[i] for i in range(n))
        weights = [layer.trainable_numel for layer in table]
        try:
            src_parts = stage_parts(method, src_pp, weights, types)
            tgt_parts = stage_parts(method, pp, weights, types)
        except ValueError as e:
            raise UsageError(f"--partition-method: {e}") from e
        source = PipelineLayout(table, src_parts, method)
        if not _reproduces(source, record):
            tried.append(source.describe())
            continue
        target = PipelineLayout(table, tgt_parts, method)
        key = (tgt_parts, tuple(target.stage_param_names(s) for s in range(pp)))
        found.setdefault(key, (source, target))
        readings.setdefault(key, ", ".join(f"layer {i} {'a use of tied ' + repr(t[0]) if t else 'a function'}"
                                           for i, t in zip(free, reading)))
    if not found:
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}': partition_method '{method}' over {n} layers does not give the source's "
            f"{src_pp} stages: it computes {tried[0] if tried else '-'}, but the files show {_observed(record)}. Name "
            "the method the run was trained with (--partition-method parameters|uniform|type:REGEX)"
            + (f"; layers past layer_{last - 1:02d} (functions, tied uses with a forward_fn) have no file: count them "
               "with --num-layers" if num_layers is None else ""))
    if len(found) > 1:
        options = "; ".join(f"{readings[k]}: {t.describe()}" for k, (_, t) in found.items())
        raise UnsupportedCheckpointError(
            f"cannot reshard '{ckpt.tag_dir}' to {pp} pipeline stages: the layers without a file ({free}) can be read "
            f"in several ways that all reproduce the source's stages but give different targets ({options}); give the "
            "layer list with --layer-types, a TiedLayerSpec use written Name[key] (e.g. Embedding[embed])")
    return next(iter(found.values()))


def _parse_types(items: Sequence[str]) -> tuple[list[str], list[str | None]]:
    """``--layer-types`` items: ``Name`` or, for a ``TiedLayerSpec`` use, ``Name[key]``."""
    import re

    names: list[str] = []
    marks: list[str | None] = []
    for item in items:
        m = re.fullmatch(r"\s*([^\[\]\s]+)\s*(?:\[\s*([^\[\]\s]+)\s*\])?\s*", item)
        if m is None:
            raise UsageError(f"--layer-types: '{item}' is not a class name or Name[tied key]")
        names.append(m[1])
        marks.append(m[2])
    return names, marks


def _reproduces(layout: PipelineLayout, record: PipelineRecord) -> bool:
    """Whether ``layout``'s stages hold exactly the params (in flat order, per group) the files put on each stage."""
    for s in range(record.num_stages):
        names = layout.stage_param_names(s)
        for order in record.stage_group_orders[s]:
            members = set(order)
            if tuple(n for n in names if n in members) != tuple(order):
                return False
        if set(record.stage_params(s)) != {n for n in names if n in _trainable(record)}:
            return False
    return True


def _trainable(record: PipelineRecord) -> set[str]:
    return {n for s in range(record.num_stages) for n in record.stage_params(s)}


def _observed(record: PipelineRecord) -> str:
    out = []
    for s in range(record.num_stages):
        params = set(record.stage_params(s))
        layers = [layer.index for layer in record.layers if layer.tied_key is None and params & set(layer.param_names)]
        tied = sorted({layer.tied_key for layer in record.layers if layer.tied_key and params & set(layer.param_names)}
                      | {k for k, ns, _ in record.tied if params & set(ns)})
        out.append(f"stage {s}: layers {layers}" + (f" and tied {tied}" if tied else ""))
    return ", ".join(out)


def stage_view(ckpt: LogicalCheckpoint, stages: StagePlan, stage: int) -> LogicalCheckpoint:
    """Target stage ``stage`` as an ordinary (no pipeline) data-parallel logical checkpoint: its trainable params (a
    tied module's first copy: the copies of later stages equal it), and as its files the template source stage's
    ``mp_rank_XX_model_states.pt`` and optimizer files, which the ZeRO writers take their scalars from. The
    fragments still name every source stage's files: the writers copy each range from where it lies."""
    record = ckpt.pipeline
    assert record is not None
    names = [n for g in stages.group_orders[stage] for n in g]
    by_name = {e.name: e for e in ckpt.entries}
    missing = [n for n in names if n not in by_name]
    if missing:
        raise UnsupportedCheckpointError(f"cannot write pipeline stage {stage} of '{ckpt.tag_dir}': no stored copy of "
                                         f"{', '.join(missing[:4])}")
    entries = []
    for n in names:
        e = by_name[n]
        entries.append(dataclasses.replace(e, pieces=tuple(p for p in e.pieces if p.replica == 0)))
    # the template stage's model-states file and its optimizer files: "mp_rank_XX_" (XX the model-parallel rank,
    # stage * TP size + TP rank with tensor parallelism: see PipelineRecord.tp_rank)
    mark = record.stage_model_files[stages.templates[stage]].name.removesuffix("model_states.pt")
    files = tuple(p for p in ckpt.files if mark in p.name)
    assert all(e.piece(Role.MASTER) is not None or ckpt.zero_stage == 0 for e in entries), \
        "pipeline stage params without a master copy"  # at stage 0 (fp32) the module weights are the master
    return dataclasses.replace(ckpt, entries=tuple(entries), files=files, pp_world_size=1, pipeline=None)
