"""Are all files of a tag folder from one save? Facts every file of one save shares, compared.

DeepSpeed writes the same ``ds_config`` and ``ds_version`` into every model-states and optimizer file of
one save (0.19.8 engine.py:5017-5038, 5549-5564), the same global step, samples and world sizes into
every model-states file, and keeps the loss scaler, the optimizer's hyper-parameters and Adam's step
count identical on every rank. Files that disagree on any of these were mixed in from another run (or
another step of the same run). Reads a few one-element tensors (step counts); no other tensor data.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any

from ..safe_load import DeepSpeedObject, TensorRef

__all__ = ["file_facts", "same_save_problems"]


_MODEL_FACTS = ("global_steps", "global_samples", "skipped_steps", "dp_world_size", "mp_world_size",
                "ds_version", "ds_config")
_OPTIM_FACTS = ("zero_stage", "partition_count", "loss_scaler", "dynamic_loss_scale", "overflow", "clip_grad",
                "param_groups", "adam_step")


def _plain(value: Any) -> Any:
    """A comparable, JSON-able form of a parsed value (stand-ins by their state)."""
    if isinstance(value, DeepSpeedObject):
        return {"class": f"{value.ds_module}.{value.ds_name}",
                **{k: _plain(v) for k, v in sorted(value.__dict__.items())}}
    if isinstance(value, Mapping):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if isinstance(value, TensorRef):
        return float(value.item()) if value.numel == 1 else f"<tensor {list(value.shape)}>"
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def _optim_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    osd = tree.get("optimizer_state_dict")
    if not isinstance(osd, Mapping):
        return {}
    facts: dict[str, Any] = {k: _plain(osd[k]) for k in _OPTIM_FACTS[:-2] if k in osd}
    inner = osd.get("base_optimizer_state", osd.get("optimizer_state_dict"))
    if isinstance(inner, Mapping):
        groups = inner.get("param_groups") or []
        facts["param_groups"] = [_plain({k: v for k, v in g.items() if k != "params"})
                                 for g in groups if isinstance(g, Mapping)]
        steps = set()
        for st in (inner.get("state") or {}).values():
            if isinstance(st, Mapping) and "step" in st:
                steps.add(json.dumps(_plain(st["step"])))
        facts["adam_step"] = sorted(steps)
    for k in ("ds_version", "ds_config"):
        if k in tree:
            facts[k] = _plain(tree[k])
    return facts


def _model_facts(tree: Mapping[str, Any]) -> dict[str, Any]:
    return {k: _plain(tree[k]) for k in _MODEL_FACTS if k in tree}


def same_save_problems(named_facts: Iterable[tuple[str, dict[str, Any]]]) -> list[tuple[str, str]]:
    """``(fact, message)`` for every fact on which the files disagree, naming which file holds which
    value (for nested values such as ``ds_config``: the first entries that differ). Pure."""
    by_fact: dict[str, dict[str, tuple[Any, list[str]]]] = {}
    for name, facts in named_facts:
        for key, value in facts.items():
            shown = json.dumps(value, sort_keys=True, default=str)
            by_fact.setdefault(key, {}).setdefault(shown, (value, []))[1].append(name)
    problems = []
    for key, values in by_fact.items():
        if len(values) < 2:
            continue
        groups = list(values.values())
        paths = _differing_paths([v for v, _ in groups])
        if paths:
            parts = ["; ".join(f"{key}.{p} = {_short(_at(v, p))}" for p in paths[:3]) + f" in {', '.join(files)}"
                     for v, files in groups]
        else:
            parts = [f"{_short(v)} in {', '.join(files)}" for v, files in groups]
        problems.append((key, f"files disagree ({' | '.join(parts)}); they come from different saves — "
                              "restore the odd ones from the same save, or pick another tag with --tag"))
    return problems


_ABSENT = object()


def _flat(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict) and value:
        out: dict[str, Any] = {}
        for k, v in value.items():
            out.update(_flat(v, f"{prefix}{k}."))
        return out
    return {prefix[:-1]: value} if prefix else {}


def _differing_paths(values: list[Any]) -> list[str]:
    """Dotted paths at which nested dicts differ (empty unless every value is a dict)."""
    if not all(isinstance(v, dict) for v in values):
        return []
    flats = [_flat(v) for v in values]
    keys = sorted(set().union(*flats))
    return [k for k in keys if len({json.dumps(f.get(k, "<absent>"), sort_keys=True, default=str)
                                     for f in flats}) > 1]


def _at(value: Any, path: str) -> Any:
    for part in path.split("."):
        if not isinstance(value, dict) or part not in value:
            return _ABSENT
        value = value[part]
    return value


def _short(value: Any) -> str:
    if value is _ABSENT:
        return "absent"
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 60 else text[:57] + "..."


def file_facts(files: Iterable[Path], trees: Mapping[Path, Any], tag_dir: Path) -> list[tuple[str, dict[str, Any]]]:
    """The facts of each file that every file of one save shares (``ds_config``/``ds_version`` are in
    model-states and optimizer files alike)."""
    out = []
    for path in files:
        tree = trees[path]
        if not isinstance(tree, Mapping):
            continue
        facts = _optim_facts(tree) if "optimizer_state_dict" in tree else _model_facts(tree)
        out.append((str(path.relative_to(tag_dir)), facts))
    return out
