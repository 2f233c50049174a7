"""``torch.save`` output (``.bin`` / ``.pt``): a plain ``{name: tensor}`` dict, loadable with
``torch.load`` with ``weights_only=True``. Unlike safetensors this needs the whole state dict in memory."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from pathlib import Path

import torch

from ..atomic import atomic_file

__all__ = ["write_torch"]


def write_torch(path: str | os.PathLike[str], tensors: Iterable[tuple[str, torch.Tensor]], *,
                check: Callable[[Path], None] | None = None) -> Path:
    """``torch.save`` the ``{name: tensor}`` dict atomically; ``check``: see :func:`dsckpt.atomic.atomic_file`."""
    path = Path(path)
    state = {name: t.contiguous() for name, t in tensors}
    with atomic_file(path, check=check) as f:
        torch.save(state, f)
    return path
