"""Pipeline-parallel checkpoints: one ``layer_XX-model_states.pt`` per ``PipelineModule`` entry.

``mp_rank_{s}_model_states.pt`` (one per pipeline stage ``s``) has ``module = None`` and the stage's
metadata; with ZeRO-1 or ``BF16_Optimizer`` the fp32 master of stage ``s`` is in
``[bf16_]zero_pp_rank_{d}_mp_rank_{s}_optim_states.pt`` with the stage-1/2 layout, its
``param_shapes`` naming params ``"{layer_index}.{param}"`` as ``PipelineModule.state_dict()`` does
(DEEPSPEED-NOTES 1.2, 1.3; pipe/module.py:588-643).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..errors import CorruptCheckpointError, UnsupportedCheckpointError
from ..layout import CheckpointFiles, expect_dp_ranks
from ..model import Kind, LogicalCheckpoint, Piece, Role, TensorEntry
from ..safe_load import DeepSpeedEnum, TensorRef
from .common import FileCache, is_floating, metadata_from_model_states, precision_of, step_of, whole
from .zero12 import OSD, zero12_param_entries

__all__ = ["read_pipeline"]


def read_pipeline(files: CheckpointFiles, cache: FileCache) -> LogicalCheckpoint:
    if any(tp is not None and tp > 0 for _, tp in files.layer_files):
        raise UnsupportedCheckpointError(
            f"'{files.tag_dir}' holds tensor-parallel layer files (layer_XX-model_NN-...); "
            "tensor parallelism is not supported yet"
        )
    stages = sorted(files.mp_to_model_states)
    if not stages:
        raise CorruptCheckpointError(f"'{files.tag_dir}' has layer files but no mp_rank_XX_model_states.pt")
    metas = {s: metadata_from_model_states(cache.tree(files.mp_to_model_states[s])) for s in stages}
    meta0 = metas[stages[0]]
    if meta0.tp_degree > 1:
        raise UnsupportedCheckpointError(
            f"'{files.tag_dir}' was saved with tensor parallel degree {meta0.tp_degree}; not supported yet"
        )
    buffer_names = {b for m in metas.values() for b in m.buffer_names}

    known = _param_names(files, cache, stages)
    tied_names = [n for n in known if n.startswith("tied_modules.")]
    # name -> (file, key, ref) for every tensor of every layer file
    layer_tensors: dict[str, tuple[Path, tuple[Any, ...], TensorRef]] = {}
    order: list[str] = []
    for (layer, _), path in sorted(files.layer_files.items()):
        tree = cache.tree(path)
        for key, ref in tree.items():
            if isinstance(ref, TensorRef):
                name = f"{layer}.{key}"
                if name not in known and name not in buffer_names:
                    name = _tied_name(key, ref, tied_names, layer_tensors) or name
                layer_tensors[name] = (path, (key,), ref)
                order.append(name)

    entries: dict[str, TensorEntry] = {}
    optim = files.dp_mp_to_optim_states
    world = meta0.dp_world_size or max(files.optim_dp_world_size, 1)
    wrapper = "none (fp32 module weights are the master)"
    step = None
    stage_number = 0
    if optim:
        expect_dp_ranks(files, "optimizer-state", optim, world)
        for s in stages:
            optim_files = [optim[(d, s)] for d in range(world)]
            osd0 = cache.tree(optim_files[0]).get(OSD) or {}
            zs = osd0.get("zero_stage")
            keeps_padding = zs is None
            wrapper = "BF16_Optimizer" if keeps_padding else "DeepSpeedZeroOptimizer"
            stage_number = int(zs.value) if isinstance(zs, DeepSpeedEnum) else 0
            stage_entries = zero12_param_entries(
                model_states=files.mp_to_model_states[s], optim_files=optim_files, cache=cache,
                keeps_padding=keeps_padding, module_names_to_refs=layer_tensors)
            # Tied modules are trained on every stage that uses them (kept equal by an all-reduce);
            # the first stage's copy stands for all.
            for name, entry in stage_entries.items():
                entries.setdefault(name, entry)
            base = osd0.get("base_optimizer_state")
            step = step if step is not None else step_of(base.get("state") if isinstance(base, dict) else None)
    for name in order:
        if name in entries:
            continue
        path, key, ref = layer_tensors[name]
        piece = Piece(Role.MODULE, ref.dtype_name, whole(path, key, ref))
        if name in buffer_names:
            entries[name] = TensorEntry(name, ref.shape, Kind.BUFFER, False, (piece,))
        else:
            # Without optimizer files (fp32, stage 0) the module weights are the master.
            entries[name] = TensorEntry(name, ref.shape, Kind.PARAM, not optim, (piece,))
    sample = next((r.dtype_name for _, _, r in layer_tensors.values() if is_floating(r.dtype_name)), None)
    ordered = [entries[n] for n in order if n in entries] + [e for n, e in entries.items() if n not in layer_tensors]
    return LogicalCheckpoint(
        root=files.root, tag=files.tag, tag_dir=files.tag_dir, layout="pipeline",
        zero_stage=stage_number, precision=precision_of(meta0.ds_config, sample),
        dp_world_size=world, pp_world_size=len(stages), tp_world_size=1, ds_version=meta0.ds_version,
        global_steps=meta0.global_steps, global_samples=meta0.global_samples, optimizer_step=step,
        optimizer_wrapper=wrapper, entries=tuple(ordered), files=tuple(files.all_files()),
        ds_config=meta0.ds_config,
    )


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
