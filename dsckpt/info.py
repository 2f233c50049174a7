"""``info``: what a checkpoint is, and a cheap health check (metadata only: tensor data is not read,
except one-element tensors such as a step count, whose records' CRC-32s are then checked)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from .crc import has_record_crcs
from .errors import DsckptError
from .hf import classify, is_hf_folder
from .layout import list_tags
from .limits import read_small_file
from .model import Kind, LogicalCheckpoint
from .peft import peft_summary
from .readers import FileCache

__all__ = ["health_notes", "health_problems", "summarize"]

NO_CRC_NOTE = "no CRC (legacy format): bit rot cannot be detected in {files}"


def health_problems(ckpt: LogicalCheckpoint, cache: FileCache) -> list[str]:
    """Every inconsistency between the logical model and the stored tensors (empty when healthy)."""
    problems = []
    for e in ckpt.entries:
        if e.tied_to is not None:
            continue
        for piece in e.pieces:
            if piece.numel != e.numel:
                problems.append(f"{e.name}: {piece.label} copy has {piece.numel} elements, shape "
                                f"{list(e.shape)} needs {e.numel}")
                continue
            for frag in piece.fragments:
                try:
                    ref = cache.tensor(frag.file, frag.key)
                except DsckptError as err:
                    problems.append(str(err))
                    continue
                if frag.src_end > ref.numel:
                    problems.append(f"{e.name}: {piece.label} fragment in {frag.file.name} ends at "
                                    f"{frag.src_end}, the stored tensor has {ref.numel}")
    return problems


def health_notes(ckpt: LogicalCheckpoint) -> list[str]:
    """What the health check cannot vouch for (not problems): files without CRC-32s."""
    legacy = [str(p.relative_to(ckpt.tag_dir)) for p in ckpt.files if not has_record_crcs(p)]
    return [NO_CRC_NOTE.format(files=", ".join(legacy))] if legacy else []


def summarize(ckpt: LogicalCheckpoint, cache: FileCache) -> dict[str, Any]:
    """A JSON-ready description of ``ckpt``."""
    params = [e for e in ckpt.entries if e.kind is Kind.PARAM and e.tied_to is None]
    trainable = sum(e.numel for e in params if e.trainable)
    frozen = sum(e.numel for e in params if not e.trainable and not e.ambiguous)
    undetermined = sum(e.numel for e in params if e.ambiguous)
    groups: dict[str, list[str]] = {}
    for alias, source in ckpt.tied.items():
        groups.setdefault(source, [source]).append(alias)
    files = []
    for path in ckpt.files:
        files.append({"name": str(path.relative_to(ckpt.tag_dir)), "nbytes": path.stat().st_size,
                      "crc32": has_record_crcs(path)})
    problems = health_problems(ckpt, cache)
    try:
        cache.finish_checks()
    except DsckptError as err:
        problems.append(str(err))
    return {
        # a single file is named itself (its root is the folder it sits in)
        "path": str(ckpt.files[0]) if ckpt.layout in ("safetensors", "torch") and len(ckpt.files) == 1
        else str(ckpt.root),
        "tag": ckpt.tag,
        "tags": list_tags(ckpt.root),
        "layout": ckpt.layout,
        "zero_stage": ckpt.zero_stage,
        "precision": ckpt.precision.value,
        "optimizer_wrapper": ckpt.optimizer_wrapper,
        "dp_world_size": ckpt.dp_world_size,
        "pp_world_size": ckpt.pp_world_size,
        "tp_world_size": ckpt.tp_world_size,
        "deepspeed_version": ckpt.ds_version,
        "global_steps": ckpt.global_steps,
        "global_samples": ckpt.global_samples,
        "optimizer_step": ckpt.optimizer_step,
        "params": {
            "count": len(params),
            "numel_trainable": trainable,
            "numel_frozen": frozen,
            "numel_undetermined": undetermined,
            "numel_total": trainable + frozen + undetermined,
        },
        "tied": [sorted(g) for g in groups.values()],
        "buffers": [{"name": e.name, "dtype": e.stored_dtype, "shape": list(e.shape)} for e in ckpt.buffers],
        "ambiguities": [a.to_dict() | {"describe": a.describe()} for a in ckpt.ambiguities],
        "tensors": [
            {"name": e.name, "kind": e.kind.value, "trainable": None if e.ambiguous else e.trainable,
             "shape": list(e.shape),
             "dtype": e.stored_dtype, "tied_to": e.tied_to,
             "copies": sorted({p.label for p in e.pieces}),
             "tp_split": _tp_split(ckpt, e.name)}
            for e in ckpt.entries
        ],
        "files": files,
        "total_nbytes": sum(f["nbytes"] for f in files),
        "health": {"ok": not problems, "problems": problems, "notes": health_notes(ckpt)},
        "hf_trainer": hf_trainer_summary(ckpt.root),
        "moe": moe_summary(ckpt),
        "tensor_parallel": tp_summary(ckpt),
        "peft": peft_summary(ckpt),
        "autoep": autoep_summary(ckpt),
        "optimizer": optimizer_summary(ckpt),
    }


def optimizer_summary(ckpt: LogicalCheckpoint) -> dict[str, Any] | None:
    """The optimizer side of a DCP folder (None for every other layout, whose wrapper and step lines say it): the
    ``torch.optim`` class its keys point to, whether it holds optimizer state at all, each param group's params and
    hyper-parameters as saved, and what the reader noted (groups rebuilt from a flattened save, steps that differ)."""
    if ckpt.layout != "dcp":
        return None
    return {
        "type": ckpt.optimizer_type,
        "model_only": not ckpt.optimizer_groups and not any(e.state_keys for e in ckpt.entries),
        "groups": [{"index": g.index, "params": list(g.param_names),
                    "hyperparams": {k: list(v) if isinstance(v, tuple) else v for k, v in g.hyperparams}}
                   for g in ckpt.optimizer_groups],
        "notes": list(ckpt.notes),
    }


def _tp_split(ckpt: LogicalCheckpoint, name: str) -> str | None:
    tp = ckpt.tensor_parallel
    cut = tp.name_to_cut.get(ckpt.tied.get(name, name)) if tp is not None else None
    return cut.describe() if cut is not None else None


def tp_summary(ckpt: LogicalCheckpoint) -> dict[str, Any] | None:
    """Tensor-parallel layout (``None`` without TP): size, where the record came from, tensors per split kind."""
    tp = ckpt.tensor_parallel
    if tp is None:
        return None
    kinds: dict[str, int] = {}
    for cut in tp.name_to_cut.values():
        kinds[cut.kind.value] = kinds.get(cut.kind.value, 0) + 1
    return {"tp_size": tp.tp_size, "record": tp.source, "split_kinds": kinds}


def autoep_summary(ckpt: LogicalCheckpoint) -> dict[str, Any] | None:
    """DeepSpeed AutoEP layout (``None`` otherwise): the preset, expert-parallel and expert-data-parallel sizes, and
    per MoE layer its experts and stacked expert params (each a ``(num_experts, ...)`` tensor cut over the expert
    index)."""
    ae = ckpt.autoep
    if ae is None:
        return None
    return {
        "preset": ae.preset,
        "num_experts": ae.num_experts,
        "ep_size": ae.ep_size,
        "expert_dp_size": ae.expert_dp,
        "dp_size": ckpt.dp_world_size,
        "layers": [{"module": la.module_path, "layer_id": la.layer_id, "num_experts": la.num_experts,
                    "local_experts": la.num_experts // la.ep_size, "params": list(la.param_names)}
                   for la in ae.layers],
        "expert_files": len(ae.expert_files),
    }


def moe_summary(ckpt: LogicalCheckpoint) -> dict[str, Any] | None:
    """Mixture-of-Experts layout (``None`` for dense checkpoints): per MoE layer its experts and
    expert-parallel size; expert tensors carry their global expert ids."""
    moe = ckpt.moe
    if moe is None:
        return None
    return {
        "num_experts": moe.num_experts,
        "layers": [{"prefix": prefix, "num_experts": n, "ep_size": ep, "local_experts": n // ep,
                    "expert_dp_size": ckpt.dp_world_size // ep} for prefix, n, ep in moe.layers],
        "ep_sizes": list(moe.ep_sizes),
        "use_data_before_expert_parallelism": moe.data_before_expert,
        "expert_files": len(moe.expert_files),
    }


def hf_trainer_summary(root: Path) -> dict[str, Any] | None:
    """The Hugging Face Trainer / model files beside the DeepSpeed save dir, by role; ``None`` if none.
    Only names and ``trainer_state.json``'s ``global_step`` are read (no pickle is opened)."""
    if not is_hf_folder(root):
        return None
    tags = frozenset(list_tags(root))
    by_role: dict[str, list[str]] = {}
    for p in sorted(root.iterdir()):
        if not p.name.startswith("."):
            by_role.setdefault(classify(p, tag_dirs=tags).value, []).append(p.name)
    step = None
    try:
        step = json.loads(read_small_file(root / "trainer_state.json").decode("utf-8")).get("global_step")
    except (OSError, ValueError, AttributeError, DsckptError):
        pass
    return {"folder": str(root), "files": by_role, "trainer_global_step": step}
