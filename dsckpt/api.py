"""One-call conveniences over the plan/run functions."""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import TYPE_CHECKING

from .checkpoint import open_checkpoint
from .convert import ConvertResult, plan_to_fp32, run_to_fp32
from .writers.safetensors import TensorSpec

if TYPE_CHECKING:
    import torch

__all__ = ["to_fp32"]


def to_fp32(checkpoint: str | os.PathLike[str], output: str | os.PathLike[str], *, tag: str | None = None,
            dtype: str | torch.dtype = "float32", exclude_frozen: bool = False,
            max_shard_size: str | int | None = None, hf_files: bool = True, client_state: bool = True,
            force: bool = False, strict: bool = False,
            on_tensor: Callable[[TensorSpec], None] | None = None) -> ConvertResult:
    """Consolidate the checkpoint at ``checkpoint`` into ``output`` (``.safetensors`` file, folder of
    shards, ``.bin``/``.pt``, or a Lightning ``.ckpt``). Returns what was written and which tensors held inf/NaN.

    A Hugging Face Trainer folder exported to a folder also gets its model-side files (``hf_files``);
    a ``.ckpt`` carries the trainer's client state unless ``client_state`` is false (see
    :func:`dsckpt.convert.plan_to_fp32`)."""
    ckpt = open_checkpoint(checkpoint, tag=tag, check_master_copies=True)
    plan = plan_to_fp32(ckpt.logical, output, dtype=dtype, exclude_frozen=exclude_frozen,
                        max_shard_size=max_shard_size, hf_files=hf_files, client_state=client_state,
                        cache=ckpt.cache)
    return run_to_fp32(plan, ckpt.cache, force=force, strict=strict, on_tensor=on_tensor)
