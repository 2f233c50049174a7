"""dsckpt: get DeepSpeed checkpoints out of trouble — read every layout safely, consolidate to fp32,
find and repair inf/NaN tensors, reshard for a new GPU count. Reading never imports deepspeed.

Importing ``dsckpt`` is cheap: torch is imported on first use of the API below.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__all__ = [
    "Checkpoint",
    "DsckptError",
    "Kind",
    "LogicalCheckpoint",
    "Role",
    "TensorEntry",
    "__version__",
    "open_checkpoint",
    "plan_to_fp32",
    "read_checkpoint",
    "run_to_fp32",
    "summarize",
    "to_fp32",
]

_LAZY = {
    "open_checkpoint": "checkpoint",
    "Checkpoint": "checkpoint",
    "read_checkpoint": "readers",
    "LogicalCheckpoint": "model",
    "TensorEntry": "model",
    "Role": "model",
    "Kind": "model",
    "plan_to_fp32": "convert",
    "run_to_fp32": "convert",
    "to_fp32": "api",
    "summarize": "info",
    "DsckptError": "errors",
}

if TYPE_CHECKING:
    __version__: str  # pyproject.toml's version, read from the installed metadata on first use (dsckpt._version)

    from .api import to_fp32
    from .checkpoint import Checkpoint, open_checkpoint
    from .convert import plan_to_fp32, run_to_fp32
    from .errors import DsckptError
    from .info import summarize
    from .model import Kind, LogicalCheckpoint, Role, TensorEntry
    from .readers import read_checkpoint


def __getattr__(name: str) -> Any:
    if name == "__version__":
        from ._version import package_version

        return package_version()
    if name in _LAZY:
        import importlib

        module = importlib.import_module(f".{_LAZY[name]}", __name__)
        return getattr(module, name)
    raise AttributeError(f"module 'dsckpt' has no attribute {name!r}")
