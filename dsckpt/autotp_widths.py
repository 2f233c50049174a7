"""DeepSpeed AutoTP's per-rank widths at another TP size, and the ``universal_checkpoint_info`` record it writes there.

A TP checkpoint records how *its* ranks cut each param, not how AutoTP would cut it for another TP size. AutoTP
(DeepSpeed 0.19.8) sizes every split layer once, when it builds it, with
``deepspeed/module_inject/tp_shard.py:get_shard_size_list(total, tp, meta, name)``:

* ``meta.num_kv_heads`` (from the model's HF config, ``AutoTPMeta.from_model_config``: the first of
  :data:`KV_HEAD_ATTRS` set, in ``text_config`` when there is one) and ``meta.tp_grain_size`` (ds_config
  ``tensor_parallel.tp_grain_size``, default 1);
* ``name``, the layer's module name: when ``total`` is a multiple of ``num_kv_heads`` and the name is neither an MLP
  (``"mlp"`` or a MoE MLP name in it) nor exactly ``lm_head`` / ``embed_out``, the cut follows KV heads
  (``num_kv_heads // tp`` heads per rank, the first ``num_kv_heads % tp`` ranks one more); otherwise near-even
  in grains of ``tp_grain_size`` (the remainder to the last rank).

:func:`target_layout` re-derives that rule for a target size and **proves it first**: the rule at the source's TP
size must reproduce every source rank's width of every split param, or the resize is refused naming the params.
Inputs the rule needs come from the checkpoint (``ds_config``) and the HF ``config.json`` beside it
(:func:`read_autotp_meta`); without it the resize is refused. :func:`record_at` writes the target's record as
``collect_autotp_universal_checkpoint_info`` would at that size: the category patterns unchanged, every
``affine_map`` entry rebuilt by DeepSpeed's ``replicated_map`` / ``contiguous_split_map``
(``deepspeed/checkpoint/affine.py``), after checking that those rebuild the source's entries exactly.

Not derived (refused): fused sub-params (their widths come from the fused layer's own layout), Megatron-style
records (the widths are the training code's: :func:`dsckpt.tensor_parallel.megatron_layout` cuts them instead), a
vocabulary-split param whose module is not the output head (a tied embedding takes the head's widths, whose name the
record does not keep), and a target size at which a
rank would hold none of a param (fewer KV heads than TP ranks: AutoTP leaves such ranks idle; dsckpt does not
write empty shards).

Where AutoTP took its heuristic path (no HF ``tp_plan``, no preset), DeepSpeed names a layer ``parent.child``
rather than by its full module name; the substring tests give the same answer unless a farther ancestor's name
contains ``mlp`` or a MoE MLP name. The proof at the source's size catches that where it changes a width there.
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedCheckpointError, first_of
from .limits import read_small_file
from .parallel_layout import ParamCut, SplitKind, TpLayout

__all__ = ["KV_HEAD_ATTRS", "AutoTpMeta", "autotp_meta_from_config", "read_autotp_meta", "record_at",
           "shard_widths", "target_layout"]

# deepspeed/module_inject/tp_shard.py (0.19.8): _KV_HEAD_ATTRS, in probe order.
KV_HEAD_ATTRS = ("num_key_value_heads", "num_kv_heads", "multi_query_group_num", "n_head_kv", "kv_n_heads",
                 "num_attention_heads", "n_heads", "attention_heads")
_LAST_LINEAR = ("lm_head", "embed_out")
_MOE_MLP_LAYER = ("gate_proj", "up_proj", "down_proj", "w1", "w2", "w3")


@dataclass(frozen=True)
class AutoTpMeta:
    """What AutoTP's width rule reads besides the layer: ``num_kv_heads`` (None: near-even splits only),
    ``tp_grain_size``, and where they were read (for messages)."""

    num_kv_heads: int | None
    tp_grain_size: int = 1
    where: str = ""


def autotp_meta_from_config(config: Mapping[str, Any], *, tp_grain_size: int = 1,
                            where: str = "config.json") -> AutoTpMeta:
    """``AutoTPMeta.from_model_config`` on an HF config read as JSON: ``text_config`` when present, then the first of
    :data:`KV_HEAD_ATTRS` that is set. Raises :class:`~dsckpt.errors.UnsupportedCheckpointError` when none is set:
    DeepSpeed reads the config object, whose class may alias another key to these names (``attribute_map``), which
    the JSON alone does not show."""
    text = config.get("text_config")
    cfg = text if isinstance(text, Mapping) else config
    for attr in KV_HEAD_ATTRS:
        v = cfg.get(attr)
        if v is None:
            continue
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise UnsupportedCheckpointError(f"{where}: {attr} is {v!r}, not a positive integer")
        return AutoTpMeta(v, tp_grain_size, f"{attr}={v} in {where}")
    raise UnsupportedCheckpointError(
        f"{where} names no key/value head count ({', '.join(KV_HEAD_ATTRS[:3])}, ...), which DeepSpeed's AutoTP "
        "width rule reads; dsckpt cannot prove the rule without it")


def read_autotp_meta(root: Path, ds_config: Mapping[str, Any] | None) -> AutoTpMeta | None:
    """The width rule's inputs for the checkpoint saved in ``root``: ``root/config.json`` (an HF Trainer
    ``checkpoint-N/`` folder holds it beside the tag folder) and ``ds_config``'s ``tensor_parallel.tp_grain_size``.
    None when there is no ``config.json``."""
    path = Path(root) / "config.json"
    if not path.is_file():
        return None
    try:
        config = json.loads(read_small_file(path).decode("utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptCheckpointError(f"{path}: not a readable JSON model config ({e})") from e
    if not isinstance(config, Mapping):
        raise CorruptCheckpointError(f"{path}: not a JSON object")
    tp_cfg = (ds_config or {}).get("tensor_parallel") if isinstance(ds_config, Mapping) else None
    grain = tp_cfg.get("tp_grain_size", 1) if isinstance(tp_cfg, Mapping) else 1
    if not isinstance(grain, int) or isinstance(grain, bool) or grain < 1:
        raise UnsupportedCheckpointError(f"ds_config tensor_parallel.tp_grain_size is {grain!r}, "
                                         "not a positive integer")
    return autotp_meta_from_config(config, tp_grain_size=grain, where=str(path))


def shard_widths(total: int, tp: int, meta: AutoTpMeta, name: str) -> tuple[int, ...]:
    """``get_shard_size_list(total, tp, meta, name)`` of DeepSpeed 0.19.8: each TP rank's width of a dim of
    ``total`` cut by the layer named ``name``. Pure. Raises ValueError where DeepSpeed's own check (the widths tile
    the dim) would fail."""
    k, grain = meta.num_kv_heads, meta.tp_grain_size
    not_moe_mlp = not any(s in name for s in _MOE_MLP_LAYER)
    out = []
    for rank in range(tp):
        if k is not None and total % k == 0 and "mlp" not in name and name not in _LAST_LINEAR and not_moe_mlp:
            out.append(total * (k // tp + (1 if rank < k % tp else 0)) // k)
        elif total >= grain:
            grains, remainder = divmod(total, grain)
            w = (grains // tp + (1 if rank < grains % tp else 0)) * grain
            out.append(w + (remainder if rank == tp - 1 else 0))
        else:
            out.append(total // tp + (1 if rank < total % tp else 0))
    if sum(out) != total:
        raise ValueError(f"AutoTP's shard sizes {out} do not add up to {total}")
    return tuple(out)


def _layer(name: str) -> str:
    return name.rsplit(".", 1)[0] if "." in name else name


def target_layout(layout: TpLayout, tp: int, meta: AutoTpMeta | None) -> TpLayout:
    """``layout`` (an AutoTP checkpoint's) cut for ``tp`` ranks by AutoTP's own rule, proven on the source first.
    Pure. Raises :class:`~dsckpt.errors.UnsupportedCheckpointError` naming every param it cannot derive."""
    src = layout.tp_size
    if layout.source != "autotp":
        raise UnsupportedCheckpointError(
            f"changing the tensor-parallel size of a Megatron-style TP record from {src} to {tp} is not supported: "
            "its widths are the training code's, not DeepSpeed AutoTP's (dsckpt.tensor_parallel.megatron_layout cuts "
            "it in Megatron's equal parts)")
    if meta is None:
        raise UnsupportedCheckpointError(
            f"changing the tensor-parallel size from {src} to {tp} needs the model's HF config.json beside the "
            "checkpoint (in the folder holding 'latest', as an HF Trainer checkpoint-N/ has it): DeepSpeed's AutoTP "
            "cuts attention by key/value heads (num_key_value_heads), which the checkpoint does not record")
    problems: list[str] = []
    cuts: dict[str, ParamCut] = {}
    for name, c in layout.name_to_cut.items():
        if c.kind is SplitKind.REPLICATED or c.dim is None:
            cuts[name] = dataclasses.replace(c, rank_shapes=(c.full_shape,) * tp)
            continue
        if c.kind is SplitKind.SUB_PARAMS:
            problems.append(f"'{name}' is fused from {len(c.sub_widths)} sub-params, whose widths the fused layer "
                            "chooses itself")
            continue
        layer = _layer(name)
        if c.kind is SplitKind.VOCABULARY and layer.split(".")[-1] not in _LAST_LINEAR:
            problems.append(f"'{name}' is a vocabulary split taken from a tied output head, whose layer name the "
                            "record does not keep")
            continue
        total = sum(c.sub_widths[0])
        try:
            proof = shard_widths(total, src, meta, layer)
            widths = shard_widths(total, tp, meta, layer)
        except ValueError as e:
            problems.append(f"'{name}': {e}")
            continue
        if proof != c.sub_widths[0]:
            problems.append(f"'{name}': AutoTP's rule ({meta.where}, tp_grain_size {meta.tp_grain_size}) gives "
                            f"{'/'.join(map(str, proof))} at TP {src}, the checkpoint holds "
                            f"{'/'.join(map(str, c.sub_widths[0]))}, so the rule is not proven for it")
            continue
        if 0 in widths:
            problems.append(f"'{name}': AutoTP's rule cuts its {total} along dim {c.dim} as "
                            f"{'/'.join(map(str, widths))} at TP {tp} ({meta.where}): TP rank {widths.index(0)} "
                            "would hold none of it (fewer key/value heads than TP ranks)")
            continue
        shapes = []
        for w in widths:
            s = list(c.full_shape)
            s[c.dim] = w
            shapes.append(tuple(s))
        cuts[name] = dataclasses.replace(c, rank_shapes=tuple(shapes), sub_widths=(widths,))
    if problems:
        raise UnsupportedCheckpointError(
            f"changing the tensor-parallel size from {src} to {tp}: dsckpt cannot derive AutoTP's cut of "
            f"{len(problems)} param(s): {first_of(problems, 4, '; ')}")
    return TpLayout(tp, layout.source, cuts)


# --------------------------------------------------------------------------------------------
# The record at the target size (deepspeed/checkpoint/affine.py ``ParamAffineMap.to_dict``)


def _strides(shape: Sequence[int]) -> list[int]:
    out = [1] * len(shape)
    for axis in range(len(shape) - 2, -1, -1):
        out[axis] = out[axis + 1] * shape[axis + 1]
    return out


def affine_entry(cut: ParamCut) -> dict[str, Any]:
    """The ``affine_map`` entry DeepSpeed 0.19.8 writes for ``cut``: ``replicated_map`` for a replicated param,
    ``contiguous_split_map`` for a plain split, as ``to_dict`` serialises them (int rank keys, lists)."""
    shape = list(cut.full_shape)
    tp = cut.tp_size
    if cut.kind is SplitKind.REPLICATED or cut.dim is None:
        st = _strides(shape)
        piece = {"shape": list(shape), "source": [0, list(st)], "dest": [0, list(st)], "locations": list(range(tp))}
        return {"logical_shape": shape,
                "ranks": {r: {"shard_shape": list(shape), "pieces": [dict(piece)]} for r in range(tp)}}
    if cut.kind is SplitKind.SUB_PARAMS:
        raise ValueError("fused sub-params are not rebuilt")
    d = cut.dim
    src_st = _strides(shape)
    ranks: dict[int, Any] = {}
    start = 0
    for r, s in enumerate(cut.rank_shapes):
        ranks[r] = {"shard_shape": list(s),
                    "pieces": [{"shape": list(s), "source": [start * src_st[d], list(src_st)],
                                "dest": [0, _strides(s)], "locations": [r]}]}
        start += s[d]
    return {"logical_shape": shape, "ranks": ranks}


def record_at(record: Mapping[str, Any], source: TpLayout, target: TpLayout) -> dict[str, Any]:
    """The ``universal_checkpoint_info`` DeepSpeed writes for ``target``'s TP size, from the source's ``record``:
    the same keys in the same order, every ``affine_map`` entry rebuilt for the target's cut. Each source entry must
    be exactly what :func:`affine_entry` gives for the source's cut (else refused: dsckpt would not write what it
    cannot reproduce). Pure."""
    out = dict(record)
    affine = record.get("affine_map")
    params = affine.get("params") if isinstance(affine, Mapping) else None
    if not isinstance(affine, Mapping) or not isinstance(params, Mapping):
        raise UnsupportedCheckpointError("the tensor-parallel record has no affine_map to rebuild for another TP size")
    problems: list[str] = []
    new: dict[str, Any] = {}
    for pattern, entry in params.items():
        name = next((n for n in source.name_to_cut if re.match(str(pattern), n)), None)
        if name is None or name not in target.name_to_cut:
            problems.append(f"affine_map pattern {pattern!r} names no param of the checkpoint")
            continue
        try:
            if affine_entry(source.name_to_cut[name]) != entry:
                problems.append(f"'{name}': its affine_map entry is not the one DeepSpeed's replicated_map / "
                                "contiguous_split_map gives for its cut")
                continue
            new[pattern] = affine_entry(target.name_to_cut[name])
        except ValueError as e:
            problems.append(f"'{name}': {e}")
    if problems:
        raise UnsupportedCheckpointError(
            f"cannot write the tensor-parallel record for TP {target.tp_size}: {first_of(problems, 4, '; ')}")
    out["affine_map"] = {**affine, "params": new}
    return out


def autotp_note(layout: TpLayout, source_tp: int, meta: AutoTpMeta) -> str:
    """What a TP size change of an AutoTP record did, for the plan's notes."""
    split = sum(1 for c in layout.name_to_cut.values() if c.dim is not None)
    return (f"tensor parallelism {source_tp} -> {layout.tp_size}: every param cut as DeepSpeed AutoTP cuts it at "
            f"autotp_size {layout.tp_size} ({meta.where}, tp_grain_size {meta.tp_grain_size}); the rule reproduced "
            f"the source's widths of all {split} split params")
