"""Training-state health of a DeepSpeed checkpoint: the fp16 dynamic loss scaler and the steps DeepSpeed skipped.

An fp16 run's dynamic loss scale halves on every overflow (after ``hysteresis`` overflows in a row) down to
``min_loss_scale``; DeepSpeed 0.19.8's ``DynamicLossScaler.update_scale`` then raises "Current loss scale already at
minimum - cannot decrease scale anymore. Exiting run." on the next overflow, and a run resumed from that checkpoint
starts at the same floor. A checkpoint whose scale sits at its floor is therefore a finding (about the optimizer's
own state, which a resumed run inherits: STYLE 16), and its message says how to get out.

Where DeepSpeed 0.19.8 keeps it (DEEPSPEED-NOTES):

* ZeRO-1/2/3: ``optimizer_state_dict["loss_scaler"]``, a pickled ``DynamicLossScaler`` (``cur_scale``, ``min_scale``,
  ``delayed_shift`` = the configured hysteresis, ``cur_hysteresis``, ``scale_window``, ``raise_error_at_min_scale``)
  in every optimizer file (``stage_1_and_2.py``/``stage3.py`` ``state_dict``);
* stage 0 (``FP16_Optimizer``/``FP16_UnfusedOptimizer``): the model-states file's ``optimizer`` dict holds
  ``dynamic_loss_scale``, ``cur_scale``, ``cur_iter``, ``last_overflow_iter``, ``scale_factor``, ``scale_window``; the
  floor is the config's ``fp16.min_loss_scale`` (default 1), and these wrappers keep no hysteresis and never raise:
  at the floor they keep skipping overflowing steps at that scale (``fused_optimizer.py`` ``_update_scale``);
* ``skipped_steps`` and ``global_steps``: the model-states file (engine.py ``_save_checkpoint``).

Pure apart from reading the already parsed file trees through the :class:`~dsckpt.readers.common.FileCache`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .layout import OSD
from .model import LogicalCheckpoint, Precision
from .readers.common import FileCache

__all__ = ["REPAIR_HINT", "LossScaler", "TrainingState", "read_training_state"]

# DeepSpeed 0.19.8 runtime/constants.py: FP16_MIN_LOSS_SCALE_DEFAULT, FP16_HYSTERESIS_DEFAULT
_MIN_LOSS_SCALE_DEFAULT = 1.0
_DS_EXIT_MESSAGE = "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run."
#: How to get out of a loss scale at its floor (the ``repair --loss-scale`` command, issue 39 item 4).
REPAIR_HINT = "dsckpt repair CKPT OUT --loss-scale S"


def _number(v: Any) -> float | None:
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return None
    return float(v)


def _int(v: Any) -> int | None:
    return v if isinstance(v, int) and not isinstance(v, bool) else None


def _fmt(x: float) -> str:
    return f"{x:g}" if x != int(x) or abs(x) >= 1e15 else str(int(x))


@dataclass(frozen=True)
class LossScaler:
    """An fp16 run's loss scaler as saved. ``hysteresis`` is the configured number of overflows in a row before the
    scale halves (``delayed_shift``), ``hysteresis_left`` how many are left now (``cur_hysteresis``); both None where
    the wrapper keeps none (stage 0). ``floor`` is ``min_scale`` (stage 0: the config's ``min_loss_scale``)."""

    dynamic: bool
    scale: float
    floor: float | None
    hysteresis: int | None
    hysteresis_left: int | None
    scale_window: int | None
    raises_at_floor: bool  # DynamicLossScaler.raise_error_at_min_scale (ZeRO); stage-0 wrappers never raise
    source: str  # the file it was read from

    @property
    def at_floor(self) -> bool:
        return self.dynamic and self.floor is not None and self.scale <= self.floor

    def overflows_left(self) -> int:
        """Overflows the run survives from here before DeepSpeed ends it (at its floor, raising)."""
        if self.hysteresis is None or self.hysteresis == 1 or not self.hysteresis_left:
            return 0
        return max(0, self.hysteresis_left - 1)

    def describe(self) -> str:
        if not self.dynamic:
            return f"static loss scale {_fmt(self.scale)}"
        parts = [f"floor {_fmt(self.floor)}" if self.floor is not None else "floor unknown"]
        if self.hysteresis is not None:
            parts.append(f"hysteresis {self.hysteresis_left} of {self.hysteresis} left")
        return f"dynamic loss scale {_fmt(self.scale)} ({', '.join(parts)})"

    def to_dict(self) -> dict[str, Any]:
        return {"dynamic": self.dynamic, "scale": self.scale, "floor": self.floor, "hysteresis": self.hysteresis,
                "hysteresis_left": self.hysteresis_left, "scale_window": self.scale_window,
                "at_floor": self.at_floor, "source": self.source}


@dataclass(frozen=True)
class TrainingState:
    """What a checkpoint says about its run's health, apart from tensor values."""

    precision: str
    global_steps: int | None
    skipped_steps: int | None
    loss_scaler: LossScaler | None

    @property
    def worth_showing(self) -> bool:
        """An fp16 run (its loss scale), or any run that skipped steps."""
        return self.loss_scaler is not None or bool(self.skipped_steps)

    def describe(self) -> str:
        parts = [self.precision]
        if self.loss_scaler is not None:
            parts.append(self.loss_scaler.describe())
        if self.skipped_steps is not None:
            of = f" of {self.global_steps} global steps" if self.global_steps is not None else ""
            parts.append(f"skipped steps {self.skipped_steps}{of}")
        return ", ".join(parts)

    def findings(self) -> list[str]:
        """One line per finding: the loss scale sitting at its floor."""
        ls = self.loss_scaler
        if ls is None or not ls.at_floor:
            return []
        assert ls.floor is not None
        if ls.raises_at_floor:
            left = ls.overflows_left()
            fate = ("the next overflow ends the run" if left == 0 else
                    f"{left} more overflow{'s' if left > 1 else ''} in a row are skipped, the one after ends the run")
            fate += f" (DeepSpeed raises '{_DS_EXIT_MESSAGE}')"
        else:
            fate = "every later overflow is skipped at this scale, which can go no lower"
        return [f"loss scale {_fmt(ls.scale)} sits at its floor (min_scale {_fmt(ls.floor)}): {fate}, and a run "
                f"resumed from this checkpoint starts there. Resume from a copy with a higher scale: "
                f"{REPAIR_HINT} (S: a power of two above {_fmt(ls.floor)})"]

    def to_dict(self) -> dict[str, Any]:
        return {"precision": self.precision, "global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "loss_scaler": None if self.loss_scaler is None else self.loss_scaler.to_dict(),
                "findings": self.findings(), "worth_showing": self.worth_showing, "describe": self.describe()}


def read_training_state(ckpt: LogicalCheckpoint, cache: FileCache) -> TrainingState:
    """The checkpoint's :class:`TrainingState`, from its parsed model-states and optimizer files."""
    skipped: int | None = None
    scaler: LossScaler | None = None
    for f in ckpt.files:
        tree = cache.tree(f)
        if not isinstance(tree, dict):
            continue
        if skipped is None and "skipped_steps" in tree:
            skipped = _int(tree.get("skipped_steps"))
        if scaler is None and ckpt.precision is Precision.FP16:
            scaler = _scaler_in(tree, f.name, ckpt.ds_config)
    return TrainingState(ckpt.precision.value,
                         ckpt.global_steps, skipped, scaler)


def _scaler_in(tree: dict[str, Any], source: str, ds_config: dict[str, Any] | None) -> LossScaler | None:
    for key in (OSD, "optimizer"):
        osd = tree.get(key)
        if not isinstance(osd, dict):
            continue
        obj = osd.get("loss_scaler")
        if obj is not None and hasattr(obj, "__dict__") and _number(getattr(obj, "cur_scale", None)) is not None:
            a = vars(obj)
            scale = _number(a.get("cur_scale"))
            assert scale is not None
            return LossScaler(dynamic=bool(a.get("dynamic", False)), scale=scale, floor=_number(a.get("min_scale")),
                              hysteresis=_int(a.get("delayed_shift")), hysteresis_left=_int(a.get("cur_hysteresis")),
                              scale_window=_int(a.get("scale_window")),
                              raises_at_floor=bool(a.get("raise_error_at_min_scale", True)), source=source)
        cur = _number(osd.get("cur_scale"))
        if cur is not None:  # stage-0 FP16_(Unfused)Optimizer
            dynamic = bool(osd.get("dynamic_loss_scale", False))
            fp16 = (ds_config or {}).get("fp16") if isinstance(ds_config, dict) else None
            floor = _number(fp16.get("min_loss_scale")) if isinstance(fp16, dict) else None
            return LossScaler(dynamic=dynamic, scale=cur,
                              floor=(floor if floor is not None else _MIN_LOSS_SCALE_DEFAULT) if dynamic else None,
                              hysteresis=None, hysteresis_left=None, scale_window=_int(osd.get("scale_window")),
                              raises_at_floor=False, source=source)
    return None
