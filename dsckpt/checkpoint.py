"""The library's front door: open a checkpoint, look at it, stream its tensors.

Opening and planning do not import torch; reading tensors as torch tensors does.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import TYPE_CHECKING

from .model import DeprecatedStateRole, LogicalCheckpoint, Role, TensorEntry
from .readers import FileCache, read_checkpoint

if TYPE_CHECKING:
    import torch

__all__ = ["Checkpoint", "open_checkpoint"]


class Checkpoint:
    """A DeepSpeed checkpoint opened for reading. Tensors are read lazily, one at a time."""

    def __init__(self, logical: LogicalCheckpoint, cache: FileCache) -> None:
        self.logical = logical
        self._cache = cache

    @property
    def entries(self) -> tuple[TensorEntry, ...]:
        return self.logical.entries

    def names(self) -> list[str]:
        return [e.name for e in self.logical.entries]

    def tensor(self, name: str, *, role: Role | DeprecatedStateRole | None = None,
               state: str | None = None) -> torch.Tensor:
        """One tensor in its stored dtype: the fp32 master by default (else the module copy); the copy with
        ``role``; or the optimizer state ``state`` ("exp_avg", "momentum_buffer", ...). ``role=Role.EXP_AVG`` (0.1.0)
        still reads ``state="exp_avg"``, with a ``DeprecationWarning``."""
        from .assemble import read_entry

        return read_entry(self.logical.entry(name), self._cache, role, state=state)

    def iter_tensors(self, *, dtype: torch.dtype | str | None = "float32",
                     exclude_frozen: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` for every param and buffer, floating ones cast to ``dtype``
        (``None`` keeps the stored dtype)."""
        import torch

        from .assemble import iter_tensors

        want = getattr(torch, str(dtype).removeprefix("torch.")) if dtype is not None else None
        return iter_tensors(self.logical, self._cache, dtype=want, exclude_frozen=exclude_frozen)

    def state_dict(self, *, dtype: torch.dtype | str | None = "float32") -> dict[str, torch.Tensor]:
        """The whole consolidated state dict in memory (prefer :meth:`iter_tensors` for big models)."""
        return dict(self.iter_tensors(dtype=dtype))

    @property
    def cache(self) -> FileCache:
        return self._cache

    def finish_checks(self) -> int:
        """Complete the CRC-32 checks of every zip record read so far (see
        :meth:`FileCache.finish_checks`); call it before trusting what :meth:`tensor` returned.
        :meth:`iter_tensors` calls it after the last tensor."""
        return self._cache.finish_checks()


def open_checkpoint(path: str | os.PathLike[str], *, tag: str | None = None,
                    check_master_copies: bool = False) -> Checkpoint:
    """Open the DeepSpeed checkpoint at ``path`` (a save dir with ``latest``, or a tag folder).
    ``check_master_copies``: see :func:`dsckpt.readers.read_checkpoint` (on for exports of the master)."""
    cache = FileCache()
    return Checkpoint(read_checkpoint(path, tag=tag, cache=cache, check_master_copies=check_master_copies), cache)
