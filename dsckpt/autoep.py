"""The Hugging Face names and layouts of an AutoEP model: how ``AutoEPMoELayer``'s tensors map back to the HF model.

DeepSpeed 0.19.8's AutoEP presets (``deepspeed/module_inject/auto_ep_presets/*.py``, ``MoEModelPreset``) describe
the HF MoE block AutoEP replaced: the router child (``router_pattern``, ``"gate"``), the experts child
(``experts_pattern``, ``"experts"``) and its storage (``expert_storage="fused_3d"``, ``expert_w1="gate_up_proj"``,
``expert_w2="down_proj"``, ``expert_w3=None``: gate and up fused in one tensor). ``AutoEPMoELayer`` copies them
(``deepspeed/moe/ep_repack.py::_repack_fused_3d``, transformers 5's ``[E, 2 * ffn, hidden]`` layout) into

* ``<mlp>.router.gate.weight`` = ``<mlp>.gate.weight`` (the HF router linear, wrapped by AutoEP's router);
* ``<mlp>.experts.w1`` = ``gate_up_proj[:, :ffn, :]``, ``<mlp>.experts.w3`` = ``gate_up_proj[:, ffn:, :]``;
* ``<mlp>.experts.w2`` = ``down_proj``.

:func:`hf_model_view` turns the logical checkpoint back into the HF model's names and layouts, which is what
``from_pretrained`` loads: ``gate_up_proj`` is ``w1`` and ``w3`` stacked on dim 1, each a sub-param of a
``SUB_PARAMS``-style cut (:class:`~dsckpt.parallel_layout.TpBlock` runs of ``ffn * hidden`` elements at a stride of
``2 * ffn * hidden``), so no tensor is read: only the fragments are re-addressed. The router alias
``<mlp>.gate.gate.weight`` (AutoEP's second name for its router, a tied copy) is left out: the HF model has no such
name.

The presets' HF side is only taken where a fixture proves ``from_pretrained`` gives the engine's logits
(:data:`HF_PRESETS`: ``mixtral``, ``qwen3_moe``); the other presets DeepSpeed 0.19.8 ships (``deepseek_v2``,
``deepseek_v3``, ``qwen3_5_moe``, ``minimax_m3``) are read under AutoEP's names and refused for the HF export by
name. Pure: no I/O, no torch.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from pathlib import Path

from .errors import UnsupportedCheckpointError
from .model import Fragment, LogicalCheckpoint, Piece, TensorEntry
from .parallel_layout import AutoEpLayer, TpBlock

__all__ = ["HF_PRESETS", "HfExpertNames", "hf_model_view", "preset_of"]


@dataclass(frozen=True)
class HfExpertNames:
    """The HF side of one AutoEP preset (``MoEModelPreset`` fields of the same names)."""

    router: str  # router_pattern
    experts: str  # experts_pattern
    w1: str  # expert_w1: with w3 None, gate and up fused, gate rows first ([E, 2 * ffn, hidden])
    w2: str  # expert_w2
    w3: str | None  # expert_w3
    hf_model_types: tuple[str, ...]


#: Presets whose HF export is proven on a fixture (from_pretrained gives the engine's logits).
HF_PRESETS: dict[str, HfExpertNames] = {
    "mixtral": HfExpertNames("gate", "experts", "gate_up_proj", "down_proj", None, ("mixtral",)),
    "qwen3_moe": HfExpertNames("gate", "experts", "gate_up_proj", "down_proj", None, ("qwen3_moe", "qwen2_moe")),
}
#: Shipped by DeepSpeed 0.19.8, read under AutoEP's names; their HF export is not proven here.
OTHER_PRESETS = ("deepseek_v2", "deepseek_v3", "qwen3_5_moe", "minimax_m3")


def preset_of(ckpt: LogicalCheckpoint) -> str | None:
    """The run's preset: ``expert_parallel.preset_model`` of its DeepSpeed config, else the one AutoEP picks for the
    ``model_type`` of the ``config.json`` beside the save (``preset_name_for_hf_model_type``)."""
    assert ckpt.autoep is not None
    if ckpt.autoep.preset:
        return ckpt.autoep.preset
    config = ckpt.root / "config.json"
    try:
        model_type = json.loads(config.read_text(encoding="utf-8")).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return next((p for p, names in HF_PRESETS.items() if model_type in names.hf_model_types), None)


def hf_model_view(ckpt: LogicalCheckpoint, *, config_dir: Path | None = None) -> LogicalCheckpoint:
    """``ckpt`` under the HF model's names and layouts (see the module docstring); ``ckpt`` itself when it is not
    an AutoEP checkpoint. Refuses (:class:`~dsckpt.errors.UnsupportedCheckpointError`) a preset whose HF side is not
    in :data:`HF_PRESETS`."""
    ae = ckpt.autoep
    if ae is None:
        return ckpt
    preset = preset_of(ckpt)
    names = HF_PRESETS.get(preset or "")
    if names is None:
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}': AutoEP preset {preset or '(none recorded, and no config.json model_type dsckpt knows)'}"
            f": its Hugging Face names are not verified by dsckpt (verified: {', '.join(HF_PRESETS)}); export a "
            ".safetensors file instead, which keeps AutoEP's names (experts.w1/w2/w3, router.gate.weight)")
    by_name = {e.name: e for e in ckpt.entries}
    out: list[TensorEntry] = []
    done: set[str] = set()
    renamed: dict[str, str] = {}  # AutoEP name -> HF name (both halves of a fused tensor -> the fused one)
    layer_of = {n: la for la in ae.layers for n in la.param_names}
    for e in ckpt.entries:
        if e.name in done:
            continue
        if e.tied_to is not None and any(e.tied_to.startswith(x.module_path + ".router.") for x in ae.layers):
            continue  # AutoEP's alias of its router (<mlp>.gate.gate.weight): no HF model has that name
        la = layer_of.get(e.name) or next((x for x in ae.layers if e.name.startswith(x.module_path + ".router.")),
                                          None)
        if la is None:
            out.append(e)
            continue
        mp = la.module_path
        if e.name.startswith(mp + ".router."):
            hf = _router_hf_name(e.name, ae.layers, names)
            if hf == e.name:
                raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': AutoEP router param '{e.name}' has no HF name in "
                                                 f"preset {preset}")
            out.append(dataclasses.replace(e, name=hf))
            renamed[e.name] = hf
            continue
        w = e.name[len(la.expert_key_prefix) + 1:]
        hf_experts = f"{mp}.{names.experts}"
        if w == "w2":
            out.append(dataclasses.replace(e, name=f"{hf_experts}.{names.w2}"))
        elif w in ("w1", "w3") and names.w3 is not None:
            out.append(dataclasses.replace(e, name=f"{hf_experts}.{names.w1 if w == 'w1' else names.w3}"))
        elif w in ("w1", "w3"):
            gate, up = by_name[f"{la.expert_key_prefix}.w1"], by_name[f"{la.expert_key_prefix}.w3"]
            out.append(_fused(f"{hf_experts}.{names.w1}", gate, up))
            done.update((gate.name, up.name))
            renamed[gate.name] = out[-1].name
            renamed[up.name] = out[-1].name
        else:
            raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': AutoEP expert param '{e.name}' has no HF name in "
                                             f"preset {preset}")
        renamed[e.name] = out[-1].name
    # the optimizer's groups under the HF names (a fused tensor once, where its two halves were)
    groups = tuple(dataclasses.replace(g, param_names=tuple(dict.fromkeys(renamed.get(n, n) for n in g.param_names)))
                   for g in ckpt.optimizer_groups)
    return dataclasses.replace(ckpt, entries=tuple(out), optimizer_groups=groups)


def _router_hf_name(name: str, layers: tuple[AutoEpLayer, ...], names: HfExpertNames) -> str:
    """``<mlp>.router.gate.<p>`` (AutoEP's ``TokenChoiceTopKRouter`` wraps the HF router linear as ``gate``) ->
    ``<mlp>.<router>.<p>``; other names unchanged."""
    for la in layers:
        prefix = la.module_path + ".router.gate."
        if name.startswith(prefix):
            return f"{la.module_path}.{names.router}.{name[len(prefix):]}"
    return name


def _fused(name: str, gate: TensorEntry, up: TensorEntry) -> TensorEntry:
    """``cat([gate, up], dim=1)`` of two ``[E, ffn, hidden]`` entries, by re-addressing their fragments: each expert's
    ``ffn * hidden`` gate elements land first in its ``2 * ffn * hidden`` block, its up elements after them."""
    from .tensor_parallel import compose

    if gate.shape != up.shape or len(gate.shape) != 3:
        raise UnsupportedCheckpointError(f"'{gate.name}' {list(gate.shape)} and '{up.name}' {list(up.shape)} cannot "
                                         f"be fused into '{name}'")
    e, f, h = gate.shape
    run = f * h
    pieces = []
    for pg in gate.pieces:
        pu = next((p for p in up.pieces if p.same_copy(pg)), None)
        if pu is None or pu.dtype != pg.dtype:
            continue
        frags: list[Fragment] = []
        for src, first in ((pg, 0), (pu, run)):
            block = TpBlock(0, e * run, first, run_numel=run, full_stride=2 * run)
            for fr in src.fragments:
                for r in (fr.runs() if fr.strided else (fr,)):
                    # one contiguous fragment per expert half (runs of ffn * hidden elements): readers copy those
                    # straight from the mapped file, where a strided fragment is read a window at a time
                    frags.extend(x for g in compose(r, (block,)) for x in g.runs())
        pieces.append(Piece(pg.role, pg.dtype, tuple(sorted(frags, key=lambda x: x.dst_offset)), pg.replica,
                            state_key=pg.state_key))
    return TensorEntry(name, (e, 2 * f, h), gate.kind, gate.trainable and up.trainable, tuple(pieces),
                       group=gate.group)
