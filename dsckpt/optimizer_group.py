"""One param group of a checkpoint's optimizer, as saved (:class:`OptimizerGroup`).

Its own module, below both :mod:`dsckpt.model` (which re-exports it) and :mod:`dsckpt.parallel_layout` (whose
pipeline record keeps each stage's groups), so that neither imports the other.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["OptimizerGroup"]


@dataclass(frozen=True)
class OptimizerGroup:
    """One param group of the (inner) optimizer, as saved: which params it holds, its ``step`` and its
    hyper-parameters. Readers of ZeRO-1/2/3, ``BF16_Optimizer`` and stage-0 checkpoints fill them."""

    index: int  # DeepSpeed's param-group order
    param_names: tuple[str, ...]  # logical names of the params in the group, in the optimizer's order
    step: int | float | None  # the group's saved step as saved (None if the optimizer keeps none)
    hyperparams: tuple[tuple[str, Any], ...]  # the saved param_group minus 'params', values as saved

    def hyperparam(self, key: str, default: Any = None) -> Any:
        return next((v for k, v in self.hyperparams if k == key), default)
