"""The dynamic loss scaler of an fp16 checkpoint: where each rank file keeps it, and ``repair --loss-scale S``.

DeepSpeed 0.19.8 keeps the scaler in two forms (read from ``runtime/fp16/loss_scaler.py`` and the wrappers'
``state_dict``/``load_state_dict``):

* ZeRO-1/2 (``DeepSpeedZeroOptimizer``) and ZeRO-3 (``DeepSpeedZeroOptimizer_Stage3``): every rank's optimizer
  file holds ``optimizer_state_dict["loss_scaler"]``, the pickled ``DynamicLossScaler`` itself (``cur_scale,
  cur_iter, last_overflow_iter, scale_factor, scale_window, min_scale, delayed_shift, cur_hysteresis,
  consecutive_hysteresis, raise_error_at_min_scale, dtype, dynamic``) and ``dynamic_loss_scale``. Loading puts
  that object in place of the engine's own (``_load_global_state``: ``self.loss_scaler = sd.get(LOSS_SCALER,
  ...)``), so the ds_config's ``fp16`` block no longer counts: the floor (``min_scale``) and hysteresis come from
  the file. At an overflow with ``cur_hysteresis`` 1 (or ``delayed_shift`` 1) and ``cur_scale == min_scale`` it
  raises "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
* stage 0 (``FP16_Optimizer`` / ``FP16_UnfusedOptimizer``): ``optimizer`` in ``mp_rank_XX_model_states.pt`` holds
  the fields ``dynamic_loss_scale, cur_scale, cur_iter`` and, when dynamic, ``last_overflow_iter, scale_factor,
  scale_window`` (no floor, no hysteresis: those come from the ds_config; these wrappers clamp at the floor and
  never raise).

A new scaler starts (``DynamicLossScaler.__init__``, ``LossScaleConfig.__init__``) with ``cur_iter`` 0,
``last_overflow_iter`` -1 and ``cur_hysteresis = delayed_shift``: :func:`plan_loss_scale` writes those with
``cur_scale`` S and keeps every other field.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .errors import RepairError, UsageError
from .readers.common import format_key, lookup
from .stand_ins import DeepSpeedObject

__all__ = ["LossScalePlan", "ScalerSite", "apply_loss_scale", "check_loss_scale", "find_scalers",
           "plan_loss_scale", "scaler_summary"]

#: ``form`` of a site: the pickled scaler object (ZeRO) or the stage-0 wrapper's own fields
OBJECT, FIELDS = "object", "fields"
#: the fields a reset writes (besides ``cur_scale``), as DeepSpeed starts a scaler
_RESET = {"cur_iter": 0, "last_overflow_iter": -1}


@dataclass(frozen=True)
class ScalerSite:
    """Where one file keeps a loss scaler: the object or dict at ``key`` of ``file``, its fields as read."""

    file: Path
    key: tuple[Any, ...]
    form: str  # OBJECT | FIELDS
    class_name: str  # "DynamicLossScaler", "LossScaler", or the stage-0 wrapper's "fields"
    fields: Mapping[str, Any] = field(compare=False)  # plain values (:func:`_plain`)

    @property
    def dynamic(self) -> bool:
        if self.form == OBJECT:
            return self.class_name == "DynamicLossScaler" and bool(self.fields.get("dynamic", True))
        return bool(self.fields.get("dynamic_loss_scale"))


@dataclass(frozen=True)
class ScalerEdit:
    site: ScalerSite
    after: Mapping[str, Any] = field(compare=False)

    def changes(self) -> dict[str, tuple[Any, Any]]:
        return {k: (self.site.fields.get(k), v) for k, v in self.after.items() if self.site.fields.get(k) != v
                or type(self.site.fields.get(k)) is not type(v)}


@dataclass(frozen=True)
class LossScalePlan:
    scale: float
    edits: tuple[ScalerEdit, ...]

    @property
    def files(self) -> tuple[Path, ...]:
        return tuple(sorted({e.site.file for e in self.edits}))

    def describe(self) -> str:
        first = self.edits[0]
        ch = first.changes()
        parts = ", ".join(f"{k} {_fmt(a)} -> {_fmt(b)}" for k, (a, b) in ch.items() if k != "cur_scale")
        floor = first.site.fields.get("min_scale")
        lines = [f"loss scale: {_fmt(first.site.fields.get('cur_scale'))} -> {_fmt(self.scale)}"
                 + (f" (floor {_fmt(floor)})" if floor is not None else "")
                 + (f"; reset {parts}" if parts else "")
                 + f"; in {len(self.files)} file(s)"]
        for e in self.edits:
            lines.append(f"    in {e.site.file.name}{format_key(e.site.key)} ({e.site.class_name})")
        return "\n".join(lines)

    def to_dict(self) -> dict[str, Any]:
        return {"scale": self.scale, "sites": [
            {"file": str(e.site.file), "key": format_key(e.site.key), "class": e.site.class_name,
             "before": {k: _jsonable(v) for k, v in e.site.fields.items()},
             "after": {k: _jsonable(v) for k, v in e.after.items()}} for e in self.edits]}


def _fmt(x: Any) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


def _jsonable(x: Any) -> Any:
    return x if isinstance(x, (bool, int, float, str)) or x is None else str(x)


def _plain(fields: Mapping[str, Any]) -> dict[str, Any]:
    """Fields as plain Python values: numbers, bools, strings and None as they are, anything else (the scaler's
    ``dtype``, a torch stand-in) as its repr, so a plan pickles and compares without stand-ins."""
    return {k: v if isinstance(v, (bool, int, float, str)) or v is None else repr(v) for k, v in fields.items()}


def _object_fields(obj: DeepSpeedObject) -> dict[str, Any]:
    return _plain(obj.__dict__)


def find_scalers(files: list[Path], tree_of: Callable[[Path], Any]) -> list[ScalerSite]:
    """Every loss scaler the files keep (see the module docstring for where)."""
    sites = []
    for f in files:
        tree = tree_of(f)
        if not isinstance(tree, Mapping):
            continue
        for top in ("optimizer_state_dict", "optimizer"):
            d = tree.get(top)
            if not isinstance(d, Mapping):
                continue
            obj = d.get("loss_scaler")
            if isinstance(obj, DeepSpeedObject):
                sites.append(ScalerSite(f, (top, "loss_scaler"), OBJECT, obj.ds_name, _object_fields(obj)))
            elif "cur_scale" in d and "dynamic_loss_scale" in d:
                keys = ("dynamic_loss_scale", "cur_scale", "cur_iter", "last_overflow_iter", "scale_factor",
                        "scale_window")
                sites.append(ScalerSite(f, (top,), FIELDS, "fields", _plain({k: d[k] for k in keys if k in d})))
    return sites


def scaler_summary(sites: list[ScalerSite]) -> dict[str, Any] | None:
    """The scaler's fields as the first rank file keeps them (``None`` where no file keeps one)."""
    return dict(sites[0].fields) if sites else None


def plan_loss_scale(sites: list[ScalerSite], scale: float, *, precision: str, source: str) -> LossScalePlan:
    """The edit of every scaler to ``scale`` with its counters reset (pure). Raises :class:`UsageError` where the
    checkpoint has no dynamic scaler or ``scale`` is not a scale it can take."""
    if not (isinstance(scale, (int, float)) and math.isfinite(scale) and scale > 0):
        raise UsageError(f"--loss-scale {scale}: give a positive finite loss scale (e.g. 1024)")
    if precision != "fp16":
        article = "an" if precision.startswith("f") else "a"
        raise UsageError(f"--loss-scale: '{source}' is {article} {precision} run, which has no dynamic loss scaler "
                         "(only fp16 runs scale their loss); leave --loss-scale out")
    if not sites:
        raise UsageError(f"--loss-scale: '{source}' keeps no loss scaler in any file (fp16 without a DeepSpeed "
                         "optimizer wrapper?); nothing to reset")
    static = [s for s in sites if not s.dynamic]
    if static:
        s = static[0]
        raise UsageError(f"--loss-scale: '{source}' uses a static loss scale ({s.file.name}{format_key(s.key)}: "
                         f"{s.class_name}, cur_scale {_fmt(s.fields.get('cur_scale'))}), not a dynamic scaler; "
                         "--loss-scale resets a dynamic one only")
    edits = []
    for s in sites:
        floor = s.fields.get("min_scale")
        if floor is not None and scale < float(floor):
            raise UsageError(f"--loss-scale {_fmt(float(scale))} is below the floor this checkpoint's scaler keeps "
                             f"(min_scale {_fmt(floor)} in {s.file.name}{format_key(s.key)}; DeepSpeed loads the "
                             "floor from the file, not from the ds_config): give a scale >= "
                             f"{_fmt(floor)}")
        after: dict[str, Any] = {"cur_scale": float(scale)}
        after.update({k: v for k, v in _RESET.items() if k in s.fields or s.form == OBJECT})
        if s.form == OBJECT and "delayed_shift" in s.fields and "cur_hysteresis" in s.fields:
            after["cur_hysteresis"] = s.fields["delayed_shift"]
        edits.append(ScalerEdit(s, after))
    return LossScalePlan(float(scale), tuple(edits))


def apply_loss_scale(tree: Any, plan: LossScalePlan, file: Path) -> None:
    """Write the plan's fields for ``file`` into its materialized ``tree`` (in place)."""
    for e in plan.edits:
        if e.site.file.resolve() != file.resolve():
            continue
        obj = lookup(tree, e.site.key, file)
        for k, v in e.after.items():
            if isinstance(obj, DeepSpeedObject):
                obj.__dict__[k] = v
            else:
                obj[k] = v


def check_loss_scale(plan: LossScalePlan, written_root: Path, input_root: Path,
                     tree_of: Callable[[Path], Any]) -> None:
    """Re-read every edited scaler from the written copy: the planned fields, every other field as before."""
    for e in plan.edits:
        path = written_root / e.site.file.resolve().relative_to(input_root)
        obj = lookup(tree_of(path), e.site.key, path)
        got = _plain(obj.__dict__ if isinstance(obj, DeepSpeedObject) else {k: obj.get(k) for k in e.site.fields})
        want = {**e.site.fields, **e.after}
        if e.site.form == OBJECT and (type(obj).__name__ != e.site.class_name or set(got) != set(want)):
            raise RepairError(f"{path.name}{format_key(e.site.key)}: the written loss scaler is not a "
                                         f"{e.site.class_name} with the fields read; nothing was written")
        wrong = [k for k in want if got.get(k) != want[k] or type(got.get(k)) is not type(want[k])]
        if wrong:
            raise RepairError(f"{path.name}{format_key(e.site.key)}: the written loss scaler holds "
                                         f"{', '.join(f'{k}={got.get(k)!r}' for k in wrong)}, not the planned "
                                         "values; nothing was written")
