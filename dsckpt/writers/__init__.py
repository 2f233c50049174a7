"""Writers: safetensors (single file or sharded + index) and torch files."""

from .safetensors import TensorSpec, plan_shards, ShardPlan, write_safetensors, write_sharded
from .torchfile import write_torch

__all__ = ["TensorSpec", "ShardPlan", "plan_shards", "write_safetensors", "write_sharded", "write_torch"]
