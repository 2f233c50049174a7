"""Writers: safetensors (single file or sharded + index; torch-free), torch files, and DeepSpeed
files streamed storage by storage (:mod:`dsckpt.writers.torch_stream`)."""

from typing import Any

from .safetensors import ShardPlan, TensorSpec, plan_shards, write_safetensors, write_sharded

__all__ = ["ShardPlan", "TensorSpec", "plan_shards", "write_safetensors", "write_sharded", "write_torch"]


def __getattr__(name: str) -> Any:
    if name == "write_torch":  # imports torch: only on demand
        from .torchfile import write_torch

        return write_torch
    raise AttributeError(name)
