"""PEFT fine-tunes (LoRA and the other adapters of Hugging Face ``peft``) saved through DeepSpeed: recognise
them, name their tensors as PEFT's files do, and plan a merge into the base model. Pure: no tensor data is read,
torch is not imported.

What a Trainer + PEFT 0.21 + DeepSpeed 0.19.8 run saves (transformers 5, ``Trainer._save_checkpoint``): the model is
a ``PeftModel``, so the Trainer calls ``save_checkpoint(output_dir, exclude_frozen_parameters=True)``. ``global_stepN/``
then holds only the trainable params (and the buffers), under PEFT's in-memory names::

    base_model.model.<module>.lora_A.<adapter>.weight             LoRA (also lora_B, lora_embedding_A/B)
    base_model.model.<module>.lora_magnitude_vector.<adapter>.weight   DoRA
    base_model.model.<module>.modules_to_save.<adapter>.<param>   modules_to_save (a trained copy of the module)
    base_model.model.<module>.ia3_l.<adapter>                     other tuners: nn.Parameter named by adapter

and ``checkpoint-N/`` holds ``adapter_config.json`` and the adapter file the Trainer gathered in 16-bit (under
ZeRO-3 through ``_zero3_consolidated_16bit_state_dict``). PEFT's ``save_pretrained`` removes the adapter name from
each key (``peft.tuners.tuners_utils._remove_adapter_name_from_state_dict_key``: the last component when it is
the adapter name, else the second to last), ``modules_to_save.<adapter>.`` from the aux modules' keys, and
``.weight`` after DoRA's ``lora_magnitude_vector`` (``LoraModel._get_adapter_state_dict``). :func:`adapter_key`
does the same. The frozen base sits under ``base_model.model.<module>.base_layer.<param>`` (a tuner layer's
wrapped module), ``<module>.original_module.<param>`` (the untouched copy beside ``modules_to_save``) or
``base_model.model.<param>`` (not targeted); :func:`base_name` maps those to the base model's names.

Merge arithmetic (:class:`LoraMerge`) follows PEFT 0.21.2's ``merge_and_unload()`` (``safe_merge=False``) with the
adapter in fp32 (PEFT loads adapters into fp32 parameters by default, ``autocast_adapter_dtype=True``):

* LoRA: ``W' = W + transpose(B @ A, fan_in_fan_out) * scaling``, ``scaling = alpha / r`` (rsLoRA:
  ``alpha / sqrt(r)``), ``r`` and ``alpha`` per module from ``rank_pattern`` / ``alpha_pattern``
  (``peft.utils.other.get_pattern_key``); the sum runs in fp32 and is rounded to ``W``'s dtype, as the in-place
  ``W += delta`` of a 16-bit ``W`` does;
* DoRA: ``norm = ||transpose(W, f) + transpose(delta, f)||_2`` per output row (``linalg.norm(dim=1)``),
  ``W' = transpose((m / norm).view(-1, 1), f) * (W + delta)``, rounded to ``W``'s dtype;
* ``modules_to_save``: the trained copy replaces the base module's tensors.

Other tuners (IA3, LoHa, LoKr, VeRA, AdaLoRA, ...) are exported as adapters but not merged: :func:`plan_merge`
refuses them by name.
"""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import CorruptCheckpointError, UnsupportedCheckpointError, UsageError, first_of
from .hf import HfFilesPlan
from .limits import read_small_file
from .model import Kind, LogicalCheckpoint, TensorEntry

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "AdapterConfig",
    "AdapterExport",
    "LoraMerge",
    "MergeAction",
    "adapter_key",
    "base_name",
    "is_peft_names",
    "peft_summary",
    "plan_adapter_export",
    "plan_adapter_files",
    "plan_merge_actions",
    "read_adapter_config",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
PEFT_PREFIX = "base_model.model."
#: PEFT types whose merge dsckpt carries out itself (tested against PEFT's merge_and_unload).
MERGEABLE = frozenset({"LORA"})
_TYPE_NAMES = {"LORA": "LoRA", "IA3": "IA3", "LOHA": "LoHa", "LOKR": "LoKr", "VERA": "VeRA", "ADALORA": "AdaLoRA",
               "BOFT": "BOFT", "OFT": "OFT", "FOURIERFT": "FourierFT", "VBLORA": "VB-LoRA", "HRA": "HRA",
               "LN_TUNING": "LayerNorm tuning", "PROMPT_TUNING": "prompt tuning", "PREFIX_TUNING": "prefix tuning",
               "P_TUNING": "p-tuning"}


@dataclass(frozen=True)
class AdapterConfig:
    """What ``adapter_config.json`` says about the adapter (the fields dsckpt uses; ``raw`` holds them all)."""

    path: Path
    peft_type: str
    adapter_name: str
    r: int | None
    alpha: float | None
    target_modules: tuple[str, ...] | str | None
    modules_to_save: tuple[str, ...]
    rank_pattern: Mapping[str, int]
    alpha_pattern: Mapping[str, float]
    use_dora: bool
    use_rslora: bool
    fan_in_fan_out: bool
    bias: str
    base_model: str | None
    raw: Mapping[str, Any] = field(repr=False)

    @property
    def variant(self) -> str:
        """``"LoRA"``, ``"rsLoRA"``, ``"DoRA"``, ``"DoRA + rsLoRA"``, ``"IA3"``, ..."""
        if self.peft_type != "LORA":
            return _TYPE_NAMES.get(self.peft_type, self.peft_type)
        name = "DoRA" if self.use_dora else "LoRA"
        return f"{name} + rsLoRA" if self.use_dora and self.use_rslora else "rsLoRA" if self.use_rslora else name

    def module_rank_alpha(self, module: str) -> tuple[int | None, float | None]:
        """``(r, alpha)`` of one targeted module (its name in the base model), as PEFT picks them:
        the first ``rank_pattern`` / ``alpha_pattern`` key matching the end of the name, else ``r`` /
        ``lora_alpha``."""
        def pick(pattern: Mapping[str, Any], default: Any) -> Any:
            for key, value in pattern.items():
                if re.match(rf"(.*\.)?({key})$", module):
                    return value
            return default
        return pick(self.rank_pattern, self.r), pick(self.alpha_pattern, self.alpha)

    def to_dict(self) -> dict[str, Any]:
        targets = self.target_modules
        return {"type": self.peft_type, "variant": self.variant, "adapter_name": self.adapter_name, "r": self.r,
                "alpha": self.alpha, "target_modules": list(targets) if isinstance(targets, tuple) else targets,
                "modules_to_save": list(self.modules_to_save), "rank_pattern": dict(self.rank_pattern),
                "alpha_pattern": dict(self.alpha_pattern), "use_dora": self.use_dora, "use_rslora": self.use_rslora,
                "fan_in_fan_out": self.fan_in_fan_out, "base_model_name_or_path": self.base_model,
                "config": str(self.path)}


def read_adapter_config(root: str | os.PathLike[str], *, adapter_name: str = "default") -> AdapterConfig | None:
    """The adapter of a PEFT run folder (``root/adapter_config.json``, as PEFT's ``save_pretrained`` writes it
    for the ``default`` adapter), or None when there is none."""
    path = Path(root) / ADAPTER_CONFIG
    if not path.is_file():
        return None
    try:
        raw = json.loads(read_small_file(path).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"cannot read '{path}' as JSON ({e}); fix it, or pass --no-hf-files to "
                                     "export the raw state dict") from e
    if not isinstance(raw, dict) or not isinstance(raw.get("peft_type"), str):
        raise CorruptCheckpointError(f"'{path}' has no 'peft_type'; it is not a PEFT adapter config. Fix or remove "
                                     "it, or pass --no-hf-files to export the raw state dict")
    targets = raw.get("target_modules")
    alpha = raw.get("lora_alpha", raw.get("alpha"))
    return AdapterConfig(
        path=path, peft_type=raw["peft_type"].upper(), adapter_name=adapter_name,
        # AdaLoRA starts every module at init_r (its "r" is LoraConfig's unused default)
        r=raw.get("init_r") if raw["peft_type"].upper() == "ADALORA" and isinstance(raw.get("init_r"), int)
        else raw.get("r") if isinstance(raw.get("r"), int) else None,
        alpha=float(alpha) if isinstance(alpha, (int, float)) and not isinstance(alpha, bool) else None,
        target_modules=tuple(targets) if isinstance(targets, list) else targets if isinstance(targets, str) else None,
        modules_to_save=tuple(raw.get("modules_to_save") or ()),
        rank_pattern=dict(raw.get("rank_pattern") or {}), alpha_pattern=dict(raw.get("alpha_pattern") or {}),
        use_dora=bool(raw.get("use_dora")), use_rslora=bool(raw.get("use_rslora")),
        fan_in_fan_out=bool(raw.get("fan_in_fan_out")), bias=str(raw.get("bias") or "none"),
        base_model=raw.get("base_model_name_or_path"), raw=raw)


def is_peft_names(names: list[str] | tuple[str, ...]) -> bool:
    """Whether the tensor names look like a PeftModel's (``base_model.model.`` and an adapter-named part)."""
    return bool(names) and all(n.startswith(PEFT_PREFIX) for n in names) and any(
        ".default." in n or n.endswith(".default") for n in names)


def adapter_key(name: str, adapter_name: str = "default") -> str | None:
    """The key PEFT's ``save_pretrained`` writes for the in-memory tensor ``name``, or None when ``name`` is not
    part of the adapter (a base param, the ``original_module`` copy of a ``modules_to_save`` module)."""
    parts = name.split(".")
    if adapter_name not in parts[:-1] and parts[-1] != adapter_name or "original_module" in parts:
        return None
    marker = f".modules_to_save.{adapter_name}."
    if marker in name:
        return name.replace(marker, ".", 1)
    if name.endswith(f".lora_magnitude_vector.{adapter_name}.weight"):
        return name.removesuffix(f".{adapter_name}.weight")
    if parts[-1] == adapter_name:
        return ".".join(parts[:-1])
    if parts[-2] == adapter_name:
        return ".".join(parts[:-2] + parts[-1:])
    return None  # the adapter name deeper inside: not a key PEFT writes


def base_name(name: str) -> str | None:
    """The base model's name for the in-memory name of a frozen base tensor of a PeftModel
    (``base_model.model.X.base_layer.weight`` -> ``X.weight``, ``...lm_head.original_module.weight`` ->
    ``lm_head.weight``), or None for an adapter tensor or a name without the PEFT prefix."""
    if not name.startswith(PEFT_PREFIX):
        return None
    parts = name[len(PEFT_PREFIX):].split(".")
    if "modules_to_save" in parts:
        return None
    kept = [p for p in parts if p not in ("base_layer", "original_module")]
    return ".".join(kept)


@dataclass(frozen=True)
class AdapterExport:
    """The tensors of a PEFT adapter export: PEFT's file key -> the checkpoint entry (fp32 master)."""

    config: AdapterConfig
    key_to_entry: dict[str, TensorEntry]
    left_out: tuple[str, ...]  # checkpoint tensors that are not part of the adapter (frozen base params)
    base_in_checkpoint: bool  # the frozen base params are in the checkpoint (saved without exclude_frozen_parameters)

    def describe(self) -> str:
        return describe_adapter(self.config, base_in_checkpoint=self.base_in_checkpoint)


def describe_adapter(cfg: AdapterConfig, *, base_in_checkpoint: bool) -> str:
    parts = [cfg.variant]
    if cfg.r is not None:
        parts.append(f"r {cfg.r}" + (f" ({', '.join(f'{k}: {v}' for k, v in cfg.rank_pattern.items())})"
                                     if cfg.rank_pattern else ""))
    if cfg.alpha is not None:
        parts.append(f"alpha {cfg.alpha:g}" + (f" ({', '.join(f'{k}: {v}' for k, v in cfg.alpha_pattern.items())})"
                                               if cfg.alpha_pattern else ""))
    targets = cfg.target_modules
    if targets is not None:
        parts.append("targets " + (", ".join(sorted(targets)) if isinstance(targets, tuple) else repr(targets)))
    if cfg.modules_to_save:
        parts.append("modules_to_save " + ", ".join(cfg.modules_to_save))
    if cfg.fan_in_fan_out:
        parts.append("fan_in_fan_out")
    parts.append("base weights in the checkpoint" if base_in_checkpoint
                 else "base weights not in the checkpoint (saved with exclude_frozen_parameters)")
    return "; ".join(parts)


def plan_adapter_export(ckpt: LogicalCheckpoint, cfg: AdapterConfig) -> AdapterExport:
    """Map the checkpoint's tensors to PEFT's adapter-file keys. Pure.

    Raises :class:`UnsupportedCheckpointError` when two tensors map to one key or the checkpoint holds no
    tensor of the adapter (a checkpoint of another adapter name, or not of this PeftModel)."""
    key_to_entry: dict[str, TensorEntry] = {}
    left_out = []
    for e in ckpt.entries:
        key = adapter_key(e.name, cfg.adapter_name)
        if key is None:
            left_out.append(e.name)
            continue
        if key in key_to_entry:
            raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': '{key_to_entry[key].name}' and '{e.name}' both map to "
                                             f"the adapter key '{key}'; export the raw state dict (--no-hf-files)")
        key_to_entry[key] = e
    if not key_to_entry:
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}' holds no tensor of adapter '{cfg.adapter_name}' named in {cfg.path.name} (names like "
            f"'...lora_A.{cfg.adapter_name}.weight'); export the raw state dict with --no-hf-files")
    aliases = {alias for alias, _ in ckpt.excluded_ties}
    base_in = any(e.kind is Kind.PARAM and not e.trainable and base_name(e.name) is not None
                  and e.tied_to is None and e.name not in aliases for e in ckpt.entries)
    return AdapterExport(cfg, key_to_entry, tuple(left_out), base_in)


# ---------------------------------------------------------------------------------------------------------------
# merge planning


@dataclass(frozen=True)
class LoraMerge:
    """``W' = W + transpose(B @ A, fan_in_fan_out) * scaling``, DoRA-rescaled when ``magnitude`` is set.
    ``a``/``b``/``magnitude``: checkpoint entry names (fp32 masters)."""

    module: str
    a: str
    b: str
    magnitude: str | None
    r: int
    alpha: float
    scaling: float
    fan_in_fan_out: bool


@dataclass(frozen=True)
class MergeAction:
    """What the merge writes for one base tensor: the base tensor (``lora`` and ``replace_with`` None), the base
    tensor with a LoRA merged in, or a ``modules_to_save`` tensor from the checkpoint instead."""

    name: str
    lora: LoraMerge | None = None
    replace_with: str | None = None


def _modules(ckpt_names: list[str], adapter: str) -> dict[str, dict[str, str]]:
    """Base-model module path -> {"lora_A"/"lora_B"/"lora_magnitude_vector"/...: checkpoint name}."""
    out: dict[str, dict[str, str]] = {}
    pat = re.compile(rf"^{re.escape(PEFT_PREFIX)}(.+)\.(lora_A|lora_B|lora_magnitude_vector|lora_embedding_A|"
                     rf"lora_embedding_B)\.{re.escape(adapter)}(?:\.(weight|bias))?$")
    for n in ckpt_names:
        m = pat.match(n)
        if m:
            part = m[2] + ("" if m[3] in (None, "weight") else f".{m[3]}")
            out.setdefault(m[1], {})[part] = n
    return out


def plan_merge_actions(ckpt: LogicalCheckpoint, cfg: AdapterConfig, base_names_shapes: Mapping[str, tuple[int, ...]],
                       ) -> tuple[dict[str, MergeAction], tuple[str, ...]]:
    """For every base tensor, what the merge writes; and notes. Pure.

    Refuses (:class:`UnsupportedCheckpointError`, naming the method) adapters other than LoRA / rsLoRA / DoRA,
    LoRA on embedding layers, ``lora_bias``, and adapters whose modules or shapes the base does not have."""
    if cfg.peft_type not in MERGEABLE:
        raise UnsupportedCheckpointError(
            f"--merge supports LoRA, rsLoRA and DoRA adapters (peft_type LORA); '{cfg.path}' is {cfg.variant} "
            f"(peft_type {cfg.peft_type}). Export the adapter (to-fp32 without --merge) and merge it with PEFT's "
            "merge_and_unload()")
    names = [e.name for e in ckpt.entries]
    shapes = {e.name: e.shape for e in ckpt.entries}
    modules = _modules(names, cfg.adapter_name)
    problems = []
    actions: dict[str, MergeAction] = {n: MergeAction(n) for n in base_names_shapes}
    for module, parts in sorted(modules.items()):
        if "lora_embedding_A" in parts or "lora_embedding_B" in parts:
            problems.append(f"LoRA on the embedding layer '{module}' (merge it with PEFT's merge_and_unload())")
            continue
        if any(p.endswith(".bias") for p in parts):
            problems.append(f"lora_bias on '{module}'")
            continue
        if "lora_A" not in parts or "lora_B" not in parts:
            problems.append(f"'{module}' has {', '.join(sorted(parts))} but not both lora_A and lora_B")
            continue
        weight = f"{module}.weight"
        if weight not in base_names_shapes:
            problems.append(f"the base has no '{weight}' for the LoRA of '{module}'")
            continue
        a, b = shapes[parts["lora_A"]], shapes[parts["lora_B"]]
        if len(a) != 2 or len(b) != 2 or a[0] != b[1]:
            problems.append(f"'{module}': lora_A {list(a)} and lora_B {list(b)} are not a LoRA pair")
            continue
        rank = a[0]
        r, alpha = cfg.module_rank_alpha(module)
        if r != rank:
            problems.append(f"'{module}': {cfg.path.name} gives r={r}, the stored lora_A has rank {rank}")
            continue
        if alpha is None:
            problems.append(f"'{module}': {cfg.path.name} gives no lora_alpha")
            continue
        w = tuple(base_names_shapes[weight])
        out_in = (b[0], a[1])
        if w not in (out_in, out_in[::-1]):
            problems.append(f"'{module}': base weight {list(w)} does not fit lora_B @ lora_A {list(out_in)}")
            continue
        # PEFT transposes for Conv1D (GPT-2) layers, whose weight is [in, out], and sets fan_in_fan_out in the config
        # then; a square weight fits both ways, and the config decides.
        fifo = cfg.fan_in_fan_out if out_in[0] == out_in[1] else w != out_in
        mag = parts.get("lora_magnitude_vector")
        if mag is not None and shapes[mag] != (b[0],):
            problems.append(f"'{module}': DoRA magnitude {list(shapes[mag])}, expected [{b[0]}]")
            continue
        scaling = alpha / math.sqrt(r) if cfg.use_rslora else alpha / r
        actions[weight] = MergeAction(weight, lora=LoraMerge(module, parts["lora_A"], parts["lora_B"], mag, r, alpha,
                                                             scaling, fifo))
    marker = f".modules_to_save.{cfg.adapter_name}."
    for n in names:
        if marker in n:
            target = n[len(PEFT_PREFIX):].replace(marker, ".", 1) if n.startswith(PEFT_PREFIX) else None
            if target is None or target not in base_names_shapes:
                problems.append(f"modules_to_save tensor '{n}' has no base tensor '{target}'")
            elif tuple(base_names_shapes[target]) != shapes[n]:
                problems.append(f"modules_to_save tensor '{n}' {list(shapes[n])} does not fit the base's "
                                f"'{target}' {list(base_names_shapes[target])}")
            else:
                actions[target] = MergeAction(target, replace_with=n)
    others = [n for n in names if adapter_key(n, cfg.adapter_name) is not None and marker not in n
              and not any(n in parts.values() for parts in modules.values())]
    if others:
        problems.append(f"adapter tensors dsckpt cannot merge: {first_of(others, 3)}")
    if problems:
        raise UnsupportedCheckpointError(
            f"cannot merge the adapter of '{ckpt.tag_dir}' into the base: {'; '.join(problems[:4])}"
            + (f" (and {len(problems) - 4} more)" if len(problems) > 4 else "")
            + ". Export the adapter (to-fp32 without --merge) and merge with PEFT's merge_and_unload()")
    notes = []
    merged = sum(1 for a in actions.values() if a.lora is not None)
    notes.append(f"{merged} LoRA module(s) merged, {sum(1 for a in actions.values() if a.replace_with)} "
                 "modules_to_save tensor(s) replaced")
    return actions, tuple(notes)


def require_base_source(cfg: AdapterConfig, base: str | None, base_in_checkpoint: bool,
                        ckpt: LogicalCheckpoint) -> None:
    """``--merge`` needs the base weights: ``--base``, or a checkpoint that holds the frozen base."""
    if base is None and not base_in_checkpoint:
        hint = f" (adapter_config.json names '{cfg.base_model}')" if cfg.base_model else ""
        raise UsageError(f"--merge needs the base model: '{ckpt.tag_dir}' holds only the adapter (the Trainer saved "
                         f"it with exclude_frozen_parameters). Pass --base BASE_DIR, the folder of the model you "
                         f"fine-tuned{hint}")


def peft_summary(ckpt: LogicalCheckpoint) -> dict[str, Any] | None:
    """``info``'s PEFT section: the adapter (from ``adapter_config.json``), whether the base weights are in the
    checkpoint, tied params whose source the save left out; None when the checkpoint is not a PEFT run."""
    cfg = read_adapter_config(ckpt.root)
    names = [e.name for e in ckpt.entries]
    if cfg is None:
        if not is_peft_names(names):
            return None
        return {"adapter": None, "note": f"the tensor names are a PeftModel's, but '{ckpt.root}' has no "
                                         f"{ADAPTER_CONFIG}; copy the run's adapter_config.json there to export "
                                         "a PEFT adapter"}
    aliases = {alias for alias, _ in ckpt.excluded_ties}
    base_in = any(e.kind is Kind.PARAM and not e.trainable and base_name(e.name) is not None
                  and e.tied_to is None and e.name not in aliases for e in ckpt.entries)
    adapter = [n for n in names if adapter_key(n, cfg.adapter_name) is not None]
    return {"adapter": cfg.to_dict(), "describe": describe_adapter(cfg, base_in_checkpoint=base_in),
            "adapter_tensors": len(adapter), "base_in_checkpoint": base_in,
            "excluded_ties": [list(t) for t in ckpt.excluded_ties]}


def plan_adapter_files(root: Path, *, tag_dirs: frozenset[str]) -> HfFilesPlan:
    """Files of a PEFT run folder to put next to ``adapter_model.safetensors``: ``adapter_config.json`` and the
    model-side files (tokenizer, chat template; ``config.json`` unchanged, it describes the base), byte for byte.
    No config.json is needed: ``PeftModel.from_pretrained(base, OUT)`` takes the model from ``base``."""
    from .hf import FileCopy, FileRole, LeftOut, plan_export_files

    plan = plan_export_files(root, tag_dirs=tag_dirs)
    copies = [FileCopy(root / ADAPTER_CONFIG, ADAPTER_CONFIG, FileRole.MODEL_SIDE, "the adapter's config")]
    left: list[LeftOut] = []
    if plan is not None:
        copies += [FileCopy(c.source, c.dest_name, c.role, "") for c in plan.copies]
        left = [o for o in plan.left_out if o.source is not None and o.source.name != ADAPTER_CONFIG]
        left = [LeftOut(o.source, o.role, "the exported adapter replaces it" if o.source is not None
                        and o.source.name in (ADAPTER_WEIGHTS, "adapter_model.bin") else o.reason) for o in left]
    return HfFilesPlan(root, tuple(copies), tuple(left), client="PEFT")
