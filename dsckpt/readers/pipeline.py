"""Pipeline-parallel checkpoints: one ``layer_XX-model_states.pt`` per ``PipelineModule`` entry.

``mp_rank_{s}_model_states.pt`` (one per pipeline stage ``s``) has ``module = None`` and the stage's
metadata; with ZeRO-1 or ``BF16_Optimizer`` the fp32 master of stage ``s`` is in
``[bf16_]zero_pp_rank_{d}_mp_rank_{s}_optim_states.pt`` with the stage-1/2 layout, its
``param_shapes`` naming params ``"{layer_index}.{param}"`` as ``PipelineModule.state_dict()`` does
(DEEPSPEED-NOTES 1.2, 1.3; pipe/module.py:588-643).

With tensor parallelism as well (Megatron-DeepSpeed: ``PipelineModule(topology=PipeModelDataParallelTopology(num_pp,
num_mp, num_dp))``), each layer file is per TP rank, ``layer_XX-model_{t:02d}-model_states.pt`` (the topology's
``model`` coordinate, pipe/module.py:588-596), and the model-parallel rank of the ``mp_rank_{m}`` / ``*_mp_rank_{m}``
files is the rank's index among the ranks of its data-parallel coordinate, pipe-major on the topology's
``['pipe', 'data', 'model']`` axes: ``m = stage * tp + t`` (pipe/topology.py:244-315, ``get_model_parallel_rank``;
the same order ``ds_to_universal`` assumes, checkpoint/reshape_meg_2d.py ``simple_init``). Each TP rank's files are
then an ordinary pipeline checkpoint of local slices, read as such and composed into full tensors by
:func:`~dsckpt.readers.tensor_parallel.combine_tp_ranks` with the ``universal_checkpoint_info`` record that
Megatron-DeepSpeed saves in ``client_state``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError, first_of
from ..layout import OSD, CheckpointFiles, expect_dp_ranks
from ..model import Kind, LogicalCheckpoint, OptimizerGroup, Piece, Role, TensorEntry
from ..parallel_layout import PipelineLayer, PipelineRecord
from ..stand_ins import DeepSpeedEnum
from ..tensor_ref import TensorRef
from .common import (
    FileCache,
    is_floating,
    merge_stage_groups,
    metadata_from_model_states,
    optimizer_groups,
    optimizer_type,
    precision_of,
    step_of,
    whole,
)
from .pipeline_binding import LayerParams, StageBinding, bind_stage_optimizers, stand_in_key
from .stage0 import moment_pieces, state_shape
from .zero12 import zero12_optimizer_groups, zero12_param_entries

__all__ = ["BOUND_NOTE", "read_pipeline", "read_stages", "tp_rank_files", "unkeyed_note"]

#: the note of a DeepSpeed-own fp32 stage-0 pipeline save read through :mod:`.pipeline_binding`
BOUND_NOTE = ("each stage's torch optimizer state (DeepSpeed's own stage-0 save: params by index, param_shapes None) "
              "bound to the layer files' params by shape and module order (tied modules first, frozen params absent), "
              "proven: no other cut of the layers into the stages fits")


def unkeyed_note(layer: int) -> str:
    """The note of a tied module whose ``TiedLayerSpec`` key no file states."""
    return (f"the tied module saved in layer_{layer:02d}-model_states.pt is used on several stages, but no file states "
            f"its TiedLayerSpec key: named tied_modules.{stand_in_key(layer)}.*; give the key with --tied-key "
            f"{layer}=KEY")


def read_pipeline(files: CheckpointFiles, cache: FileCache,
                  tied_keys: Mapping[int, str] | None = None) -> LogicalCheckpoint:
    """``tied_keys``: layer index -> ``TiedLayerSpec`` key of the tied modules of DeepSpeed's own fp32 stage-0 save,
    which no file names (:mod:`.pipeline_binding`)."""
    if not files.mp_to_model_states:
        raise CorruptCheckpointError(f"'{files.tag_dir}' has layer files but no mp_rank_XX_model_states.pt")
    tp_size = _tp_size(files, cache)
    from .tensor_parallel import UNIVERSAL_CHECKPOINT_INFO, agreed_record, combine_tp_ranks, with_tp1_record

    if tp_size == 1:
        return with_tp1_record(read_stages(files, cache, tied_keys), cache,
                               [files.mp_to_model_states[m] for m in sorted(files.mp_to_model_states)])

    pp_size = len(files.mp_to_model_states) // tp_size
    ranks = [read_stages(tp_rank_files(files, t, tp_size), cache, tied_keys) for t in range(tp_size)]
    record, where = agreed_record(cache, [files.mp_to_model_states[m] for m in sorted(files.mp_to_model_states)])
    ckpt = combine_tp_ranks(ranks, record, where=where)
    assert ckpt.pipeline is not None
    pipeline = dataclasses.replace(
        ckpt.pipeline, tp_size=tp_size, layer_files=tuple(p for _, p in sorted(files.layer_files.items())),
        mp_model_files=tuple(files.mp_to_model_states[m] for m in sorted(files.mp_to_model_states)))
    return dataclasses.replace(
        ckpt, pp_world_size=pp_size, files=tuple(files.all_files()), pipeline=pipeline,
        notes=(*ckpt.notes, (f"pipeline parallelism {pp_size} x tensor parallelism {tp_size}: model-parallel rank "
                             f"m = stage * {tp_size} + TP rank (PipeModelDataParallelTopology); "
                             f"{UNIVERSAL_CHECKPOINT_INFO} from client_state")))


def _tp_size(files: CheckpointFiles, cache: FileCache) -> int:
    """The TP size of a pipeline checkpoint, from its layer files' ``model_NN`` and the model-states files' recorded
    ``checkpoint_parallel_dimensions``; every disagreement is refused (all missing files listed)."""
    where = files.tag_dir
    models = {m for _, m in files.layer_files}
    if None in models and len(models) > 1:
        raise CorruptCheckpointError(f"'{where}' mixes layer files with and without a TP rank (layer_XX-model_NN-...); "
                                     "the files come from different runs")
    tp = 1 if None in models else max(m for m in models if m is not None) + 1
    meta = metadata_from_model_states(cache.tree(files.mp_to_model_states[min(files.mp_to_model_states)]))
    if tp == 1:
        if meta.tp_degree > 1:
            raise CorruptCheckpointError(
                f"'{where}' was saved with tensor parallel degree {meta.tp_degree} (checkpoint_parallel_dimensions) "
                "but its layer files carry no TP rank (layer_XX-model_NN-...); the files come from different runs")
        return 1
    layers = sorted({layer for layer, _ in files.layer_files})
    missing = [f"layer_{layer:02d}-model_{t:02d}" for layer in layers for t in range(tp)
               if (layer, t) not in files.layer_files]
    if missing:
        raise IncompleteCheckpointError(
            f"'{where}' holds tensor-parallel layer files for {tp} TP ranks but lacks {first_of(missing, 6)}"
            "; the save was probably interrupted; pick another tag with --tag")
    mps = sorted(files.mp_to_model_states)
    pp = meta.pp_degree if meta.tp_degree == tp and meta.pp_degree > 1 else len(mps) // tp
    if meta.tp_degree not in (1, tp) or mps != list(range(pp * tp)):
        raise IncompleteCheckpointError(
            f"'{where}' holds layer files for {tp} TP ranks and {len(mps)} mp_rank_XX_model_states.pt files "
            f"(checkpoint_parallel_dimensions: pipeline {meta.pp_degree}, tensor {meta.tp_degree}); expected "
            f"mp_rank_00 .. mp_rank_{pp * tp - 1:02d} (pipeline stages x TP ranks); the save was probably interrupted "
            "or files of another run were added; pick another tag with --tag")
    no_optim = sorted(set(mps) - {mp for _, mp in files.dp_mp_to_optim_states}) if files.dp_mp_to_optim_states else []
    if no_optim:
        raise IncompleteCheckpointError(
            f"'{where}' has no optimizer-state files for model-parallel rank(s) {no_optim} (pipeline stage, TP rank "
            f"{', '.join(f'({m // tp}, {m % tp})' for m in no_optim)}); the save was probably interrupted; pick "
            "another tag with --tag")
    return tp


def tp_rank_files(files: CheckpointFiles, t: int, tp_size: int) -> CheckpointFiles:
    """TP rank ``t``'s files of a TP x pipeline checkpoint, as a plain pipeline checkpoint: model-parallel rank
    ``stage * tp_size + t`` renumbered as stage, layer files ``layer_XX-model_{t}`` as ``layer_XX``."""
    return dataclasses.replace(
        files,
        mp_to_model_states={mp // tp_size: p for mp, p in files.mp_to_model_states.items() if mp % tp_size == t},
        dp_mp_to_optim_states={(d, mp // tp_size): p for (d, mp), p in files.dp_mp_to_optim_states.items()
                               if mp % tp_size == t},
        layer_files={(layer, None): p for (layer, m), p in files.layer_files.items() if m == t},
    )


def read_stages(files: CheckpointFiles, cache: FileCache,
                tied_keys: Mapping[int, str] | None = None) -> LogicalCheckpoint:
    """A pipeline checkpoint without tensor parallelism (or one TP rank's files of one, see :func:`tp_rank_files`)."""
    stages = sorted(files.mp_to_model_states)
    metas = {s: metadata_from_model_states(cache.tree(files.mp_to_model_states[s])) for s in stages}
    meta0 = metas[stages[0]]
    buffer_names = {b for m in metas.values() for b in m.buffer_names}

    optim = files.dp_mp_to_optim_states
    world = meta0.dp_world_size or max(files.optim_dp_world_size, 1)
    named0: dict[int, Mapping[str, Any]] = {}  # stage -> its torch optimizer state dict (fp32, no ZeRO)
    bound: StageBinding | None = None  # DeepSpeed's own stage-0 save: its states bound to names by shape and order
    if optim:
        expect_dp_ranks(files, "optimizer-state", optim, world)
    else:
        named0 = _named_stage0_optimizers(files, cache, stages)
        if named0 and not isinstance(cache.tree(files.mp_to_model_states[stages[0]]).get("param_shapes"), list):
            bound = _bind_unnamed(files, cache, stages, named0, buffer_names, tied_keys)
    # BF16_Optimizer without ZeRO (bf16 pipeline at stage 0) saves param_shapes None: its optimizer files name the
    # params of each partition (param_slice_mappings), which give the flat order; the layer files give the shapes
    flat_names = {s: _slice_mapping_order([optim[(d, s)] for d in range(world)], cache) for s in stages
                  if optim and cache.tree(files.mp_to_model_states[s]).get("param_shapes") is None}
    known = _param_names(files, cache, stages) | {n for order in flat_names.values() for g in order for n, _ in g}
    renames = bound.renames if bound is not None else {}
    known |= set(renames.values())
    tied_names = [n for n in known if n.startswith("tied_modules.")]
    # name -> (file, key, ref) for every tensor of every layer file
    layer_tensors: dict[str, tuple[Path, tuple[Any, ...], TensorRef]] = {}
    order: list[str] = []
    for (layer, _), path in sorted(files.layer_files.items()):
        tree = cache.tree(path)
        for key, ref in tree.items():
            if isinstance(ref, TensorRef):
                name = renames.get(f"{layer}.{key}", f"{layer}.{key}")
                if name not in known and name not in buffer_names:
                    name = _tied_name(key, ref, tied_names, layer_tensors) or name
                layer_tensors[name] = (path, (key,), ref)
                order.append(name)

    shapes_of = {s: cache.tree(files.mp_to_model_states[s]).get("param_shapes") for s in stages}
    if bound is not None:
        shapes_of.update({s: list(bound.param_shapes[i]) for i, s in enumerate(stages)})
    shapes_of.update({s: _shapes_from_layers(order, layer_tensors, files.mp_to_model_states[s])
                      for s, order in flat_names.items()})
    entries: dict[str, TensorEntry] = {}
    wrapper = "none (fp32 module weights are the master)"
    step = None
    stage_number = 0
    stage_groups: list[tuple[OptimizerGroup, ...]] = []
    if optim:
        for s in stages:
            optim_files = [optim[(d, s)] for d in range(world)]
            osd0 = cache.tree(optim_files[0]).get(OSD) or {}
            zs = osd0.get("zero_stage")
            keeps_padding = zs is None
            wrapper = "BF16_Optimizer" if keeps_padding else "DeepSpeedZeroOptimizer"
            # BF16_Optimizer files carry no zero_stage: the config says (stage 0, or 1 with fp32 grad accumulation)
            stage_number = int(zs.value) if isinstance(zs, DeepSpeedEnum) else int(
                ((meta0.ds_config or {}).get("zero_optimization") or {}).get("stage", 0))
            stage_entries = zero12_param_entries(
                model_states=files.mp_to_model_states[s], optim_files=optim_files, cache=cache,
                keeps_padding=keeps_padding, module_names_to_refs=layer_tensors, param_shapes=shapes_of[s])
            # Tied modules are trained on every stage that uses them (kept equal by an all-reduce of their
            # grads): the first stage's copy stands for all, the later stages' optimizer copies are replicas
            # that must equal it (verify compares them, scan checks them).
            for name, entry in stage_entries.items():
                entries[name] = entry if name not in entries else _with_stage_copy(entries[name], entry)
            base = osd0.get("base_optimizer_state")
            step = step if step is not None else step_of(base.get("state") if isinstance(base, dict) else None)
            # each stage's own optimizer: its groups hold the stage's params (param_shapes of its model states)
            stage_groups.append(zero12_optimizer_groups(
                base, shapes_of[s], meta0.ds_config, world, keeps_padding))
    for s in named0:  # fp32 without ZeRO, param_shapes naming each stage's torch optimizer params
        stage_entries = _stage0_param_entries(files.mp_to_model_states[s], named0[s], shapes_of[s], layer_tensors)
        for name, entry in stage_entries.items():  # a tied module's later stages: replicas, as above
            entries[name] = entry if name not in entries else _with_stage_copy(entries[name], entry)
        wrapper = "torch optimizer"
        step = step if step is not None else step_of(named0[s].get("state"))
        state = named0[s].get("state") or {}
        groups_of = named0[s].get("param_groups") or []
        stage_groups.append(optimizer_groups(groups_of, [list(g) for g in shapes_of[s]], [
            next((state[k] for k in pg.get("params") or [] if k in state), None) for pg in groups_of]))
    for name in order:
        if name in entries:
            continue
        path, key, ref = layer_tensors[name]
        piece = Piece(Role.MODULE, ref.dtype_name, whole(path, key, ref))
        if name in buffer_names:
            entries[name] = TensorEntry(name, ref.shape, Kind.BUFFER, False, (piece,))
        else:
            # Without optimizer state (fp32, stage 0) the module weights are the master; where param_shapes name
            # the optimizer's params, one it does not name is frozen (as with ZeRO)
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, not optim and not named0, (piece,))
    sample = next((r.dtype_name for _, _, r in layer_tensors.values() if is_floating(r.dtype_name)), None)
    ordered = [entries[n] for n in order if n in entries] + [e for n, e in entries.items() if n not in layer_tensors]
    record = dataclasses.replace(_record(files, cache, stages, layer_tensors, entries, buffer_names, shapes_of),
                                 stage_optimizer_groups=tuple(stage_groups))
    notes: tuple[str, ...] = ()
    if bound is not None:
        record = dataclasses.replace(record, unkeyed_tied=bound.unkeyed,
                                     tied_keys=tuple(sorted((tied_keys or {}).items())))
        notes = (BOUND_NOTE,) + tuple(unkeyed_note(i) for i in bound.unkeyed)
    groups, _ = merge_stage_groups(stage_groups)
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="pipeline",
        zero_stage=stage_number, precision=precision_of(meta0.ds_config, sample),
        dp_world_size=world, pp_world_size=len(stages), tp_world_size=1, ds_version=meta0.ds_version,
        global_steps=meta0.global_steps, global_samples=meta0.global_samples, optimizer_step=step,
        optimizer_wrapper=wrapper, entries=tuple(ordered), files=tuple(files.all_files()),
        ds_config=meta0.ds_config, pipeline=record, optimizer_groups=groups,
        optimizer_type=optimizer_type(meta0.ds_config), notes=notes,
    )


def _record(files: CheckpointFiles, cache: FileCache, stages: list[int],
            layer_tensors: dict[str, tuple[Path, tuple[Any, ...], TensorRef]], entries: dict[str, TensorEntry],
            buffer_names: set[str], shapes_of: dict[int, Any]) -> PipelineRecord:
    """The stage facts the files state (:class:`~dsckpt.parallel_layout.PipelineRecord`): which layers have a file
    and the params each owns, the tied modules, and each stage's optimizer groups in flat order."""
    import math

    def trainable(n: str) -> bool:
        e = entries.get(n)
        return e is not None and e.kind is Kind.PARAM and e.trainable

    def numel(n: str) -> int:
        return math.prod(layer_tensors[n][2].shape) if n in layer_tensors else 0

    orders = []
    for s in stages:
        shapes = shapes_of[s] or []
        orders.append(tuple(tuple(str(n) for n in group) for group in shapes))
    tied_keys: dict[str, list[str]] = {}
    for n in (*layer_tensors, *(n for o in orders for g in o for n in g)):
        if n.startswith("tied_modules.") and n not in buffer_names:
            names = tied_keys.setdefault(n.split(".")[1], [])
            if n not in names:
                names.append(n)
    layers = []
    for (index, _), path in sorted(files.layer_files.items()):
        own = [n for n, (p, _, _) in layer_tensors.items() if p == path and n not in buffer_names]
        key = next((n.split(".")[1] for n in own if n.startswith("tied_modules.")), None)
        if key is not None:
            own = tied_keys[key]
        layers.append(PipelineLayer(index, tuple(own), sum(numel(n) for n in own if trainable(n)), key))
    tied = tuple((k, tuple(ns), sum(numel(n) for n in ns if trainable(n))) for k, ns in tied_keys.items())
    stage_buffers = tuple(tuple(str(b) for b in metadata_from_model_states(
        cache.tree(files.mp_to_model_states[s])).buffer_names) for s in stages)
    return PipelineRecord(tuple(layers), tuple(orders), tuple(files.mp_to_model_states[s] for s in stages),
                          tuple(p for _, p in sorted(files.layer_files.items())), tied, stage_buffers)


def _with_stage_copy(first: TensorEntry, later: TensorEntry) -> TensorEntry:
    """``first`` with ``later``'s optimizer-side copies (fp32 master, moments) added as one more replica that must
    equal replica 0. The module copy is not repeated: only the first stage's layer file holds it."""
    replica = 1 + max((p.replica for p in first.pieces), default=0)
    extra = tuple(dataclasses.replace(p, replica=replica, same_as=0) for p in later.pieces
                  if p.role is not Role.MODULE and p.replica == 0)
    return dataclasses.replace(first, pieces=first.pieces + extra) if extra else first


def _named_stage0_optimizers(files: CheckpointFiles, cache: FileCache,
                             stages: list[int]) -> dict[int, Mapping[str, Any]]:
    """Per stage, the torch optimizer ``state_dict()`` an fp32 pipeline run without ZeRO keeps in its
    ``mp_rank_XX_model_states.pt``; ``{}`` where no stage holds optimizer state. Either every stage's
    ``param_shapes`` names its params (dsckpt's stage-0 pipeline files, ``ds_writers.stage0.PIPELINE_NOTE``) or none
    does (DeepSpeed 0.19.8's own save: params by index only, bound by :mod:`.pipeline_binding`); a mix, or a stage
    without optimizer state, is refused."""
    trees = {s: cache.tree(files.mp_to_model_states[s]) for s in stages}
    held = [s for s in stages if isinstance(opt := trees[s].get("optimizer"), Mapping)
            and (opt.get("state") or opt.get("param_groups"))]
    if not held:
        return {}
    named = [s for s in stages if isinstance(trees[s].get("param_shapes"), list)]
    if held == stages and named in (stages, []):
        return {s: trees[s]["optimizer"] for s in stages}
    raise CorruptCheckpointError(
        f"'{files.tag_dir}' is a pipeline run without ZeRO whose stages disagree: stage(s) {held} of {stages} hold a "
        f"torch optimizer state in mp_rank_XX_model_states.pt, stage(s) {named} name its params (param_shapes); the "
        "files come from different runs or are damaged; pick another tag with --tag")


def _bind_unnamed(files: CheckpointFiles, cache: FileCache, stages: list[int], optimizers: dict[int, Mapping[str, Any]],
                  buffer_names: set[str], tied_keys: Mapping[int, str] | None) -> StageBinding:
    """DeepSpeed's own fp32 stage-0 save: each stage's optimizer state bound to the layer files' params
    (:func:`.pipeline_binding.bind_stage_optimizers`)."""
    layers = []
    for (layer, _), path in sorted(files.layer_files.items()):
        params = tuple((str(k), tuple(ref.shape)) for k, ref in cache.tree(path).items()
                       if isinstance(ref, TensorRef) and f"{layer}.{k}" not in buffer_names)
        layers.append(LayerParams(layer, params))
    return bind_stage_optimizers([optimizers[s] for s in stages], layers, tied_keys=tied_keys, tag_dir=files.tag_dir,
                                 model_files=[files.mp_to_model_states[s] for s in stages])


def _stage0_param_entries(path: Path, optimizer: Mapping[str, Any], param_shapes: Any,
                          layer_tensors: dict[str, tuple[Path, tuple[Any, ...], TensorRef]]) -> dict[str, TensorEntry]:
    """One stage's trainable params of an fp32 pipeline without ZeRO whose ``param_shapes`` name its torch optimizer's
    params (group ``g``'s ``params`` indices in the order of ``param_shapes[g]``): the module copy from the layer
    files (the master), the per-element states from ``optimizer.state[k]``. Bound by the names, proven by shape: each
    named param's layer tensor and every per-element state must have the shape ``param_shapes`` records."""
    groups = optimizer.get("param_groups")
    if not isinstance(param_shapes, list) or not isinstance(groups, list) or len(groups) != len(param_shapes):
        raise CorruptCheckpointError(
            f"{path}: param_shapes names {len(param_shapes) if isinstance(param_shapes, list) else 'no'} optimizer "
            f"groups and the optimizer holds {len(groups) if isinstance(groups, list) else 'no'}; the file is damaged")
    state = optimizer.get("state") or {}
    entries: dict[str, TensorEntry] = {}
    for g, (pg, shapes) in enumerate(zip(groups, param_shapes)):
        indices = pg.get("params") if isinstance(pg, Mapping) else None
        if not isinstance(shapes, Mapping) or not isinstance(indices, list) or len(indices) != len(shapes):
            raise CorruptCheckpointError(
                f"{path}: optimizer group {g} holds {len(indices) if isinstance(indices, list) else 'no'} params and "
                f"param_shapes[{g}] names {len(shapes) if isinstance(shapes, Mapping) else 'none'}; the file is "
                "damaged")
        for k, (name, shape) in zip(indices, shapes.items()):
            where = layer_tensors.get(str(name))
            st = state.get(k) if isinstance(state, Mapping) else None
            have = state_shape(st)
            if where is None or tuple(where[2].shape) != tuple(shape) or (have is not None and have != tuple(shape)):
                got = f"a {list(where[2].shape)} tensor" if where is not None else "no tensor"
                raise CorruptCheckpointError(
                    f"{path}: param_shapes[{g}] names '{name}' {list(shape)} (optimizer.state[{k}]"
                    f"{f' {list(have)}' if have is not None else ''}), and the layer files hold {got} of that name; "
                    "the files come from different runs or are damaged")
            lpath, key, ref = where
            if ref.dtype_name != "float32":
                raise UnsupportedCheckpointError(f"{lpath}: '{name}' is {ref.dtype_name}; a pipeline run without ZeRO "
                                                 "keeps a torch optimizer (module weights as the master) at fp32 only")
            module = Piece(Role.MODULE, ref.dtype_name, whole(lpath, key, ref))
            entries[str(name)] = TensorEntry(str(name), ref.shape, Kind.PARAM, True,
                                             (*moment_pieces(path, ("optimizer", "state", k), st, 0, ref.numel),
                                              module), group=g)
    return entries


def _slice_mapping_order(optim_files: list[Path], cache: FileCache) -> list[list[tuple[str, int]]]:
    """Per optimizer group, its params ``(name, numel)`` in flat order, from every data-parallel rank's
    ``param_slice_mappings`` (``{name: fragment_address(numel, start)}`` for the params meeting the rank's partition;
    ``BF16_Optimizer`` keeps each partition's padding, so rank ``r``'s element ``start`` is flat element ``r *
    partition + start``). The fragments must tile the flat group from element 0 without a gap, as
    ``BF16_Optimizer``'s flat buffer does (padding at its end only); otherwise the files are refused."""
    groups: list[dict[str, list[tuple[int, int]]]] = []
    for r, path in enumerate(optim_files):
        osd = cache.tree(path).get(OSD)
        maps = osd.get("param_slice_mappings") if isinstance(osd, Mapping) else None
        parts = osd.get("single_partition_of_fp32_groups") if isinstance(osd, Mapping) else None
        if not isinstance(maps, list) or not isinstance(parts, list) or len(maps) != len(parts) or not all(
                isinstance(p, TensorRef) for p in parts):
            raise CorruptCheckpointError(
                f"{path}: its model states save no param_shapes, and it has no param_slice_mappings with one entry "
                "per fp32 group to name the params by; the file is damaged or not a BF16_Optimizer file")
        while len(groups) < len(maps):
            groups.append({})
        for g, (mapping, part) in enumerate(zip(maps, parts)):
            for name, addr in (mapping.items() if isinstance(mapping, Mapping) else ()):
                start, numel = getattr(addr, "start", None), getattr(addr, "numel", None)
                if not isinstance(start, int) or not isinstance(numel, int) or start < 0 or numel < 1 \
                        or start + numel > part.numel:
                    raise CorruptCheckpointError(f"{path}: param_slice_mappings[{g}]['{name}'] is not a range of the "
                                                 f"rank's {part.numel}-element fp32 partition; the file is damaged")
                groups[g].setdefault(str(name), []).append((r * part.numel + start, numel))
    out = []
    for g, by_name in enumerate(groups):
        pos = 0
        order = []
        for name, frags in sorted(by_name.items(), key=lambda kv: min(kv[1])):
            for offset, numel in sorted(frags):
                if offset != pos:
                    raise CorruptCheckpointError(
                        f"'{optim_files[0].parent}': param_slice_mappings of group {g} put '{name}' at flat element "
                        f"{offset}, where element {pos} was expected; the optimizer files do not tile the flat group "
                        "(damaged, or from different runs)")
                pos += numel
            order.append((name, sum(n for _, n in frags)))
        out.append(order)
    return out


def _shapes_from_layers(order: list[list[tuple[str, int]]],
                        layer_tensors: dict[str, tuple[Path, tuple[Any, ...], TensorRef]],
                        model_states: Path) -> list[dict[str, tuple[int, ...]]]:
    """``param_shapes`` rebuilt: each param of the flat order with the shape of its layer-file tensor, whose element
    count must be the one the optimizer files map."""
    out = []
    for g, group in enumerate(order):
        shapes = {}
        for name, numel in group:
            ref = layer_tensors.get(name, (None, None, None))[2]
            if ref is None or ref.numel != numel:
                have = f"a {list(ref.shape)} tensor" if ref is not None else "no tensor"
                raise CorruptCheckpointError(
                    f"{model_states}: the optimizer files map {numel} elements of group {g} to '{name}', and the "
                    f"layer files hold {have} of that name; the files come from different runs")
            shapes[name] = tuple(ref.shape)
        out.append(shapes)
    return out


def _param_names(files: CheckpointFiles, cache: FileCache, stages: list[int]) -> set[str]:
    names: set[str] = set()
    for s in stages:
        ms = cache.tree(files.mp_to_model_states[s])
        for group in ms.get("param_shapes") or []:
            names.update(group)
        names.update(ms.get("frozen_param_shapes") or {})
    return names


def _tied_name(key: str, ref: TensorRef, tied_names: list[str],
               taken: dict[str, tuple[Path, tuple[Any, ...], TensorRef]]) -> str | None:
    """A tied module is saved in the layer file of its first use (``layer.state_dict()`` keys), but
    ``PipelineModule.state_dict()`` names it ``tied_modules.<key>.<param>``: match by param name."""
    matches = [n for n in tied_names if n.endswith("." + key) and n not in taken]
    return matches[0] if len(matches) == 1 else None
