"""DeepSpeed's ZeRO-3 NVMe optimizer swap files (ZeRO-Infinity, ``offload_optimizer.device: nvme``), 0.19.8.

With NVMe optimizer offload, ZeRO-3 keeps the fp32 master partition of every fp32 sub-group that is large
enough on disk, with each optimizer state tensor of it (``runtime/zero/stage3.py`` ``_create_fp32_partitions``,
``runtime/swap_tensor/optimizer_utils.py``):

* a sub-group is swapped when its per-rank partition holds at least ``max(1 MiB, aio.block_size)`` bytes of
  fp32 (``OptimizerSwapper.is_swappable_tensor``); smaller ones stay in memory and are saved as usual;
* the swap id of a sub-group is ``"{first}_{last}"``, the ``ds_id`` s of its first and last param;
  the master is ``{id}.tensor.swp``, each state tensor ``{key}-{id}.tensor.swp`` (``exp_avg-3_9.tensor.swp``);
  a state tensor below the same size (Adam's one-element ``step``) is not swapped;
* a file holds the raw elements, padded with whatever follows to a multiple of
  ``1024 * aio.intra_op_parallelism`` bytes (``_io_aligned_numel``); no header, no checksum;
* ``save_checkpoint`` saves the swapped sub-groups' master and state as **empty tensors** in the optimizer
  file and copies the rank's swap folder (gradient files left out) to ``<tag>/offloaded_tensors/rank{NN}/``
  (``NN`` the global rank, two digits; engine.py ``save_checkpoint``);
* ``load_checkpoint`` with NVMe offload **skips the optimizer files entirely** (no ``_load_zero_checkpoint``:
  no step count, loss scaler or unswapped sub-group is read) and copies ``offloaded_tensors/rank{NN}/`` back
  into the swap folder, from which the swapped masters and moments are then read (engine.py
  ``load_checkpoint``, stage3.py ``reset_swap_buffers``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

__all__ = [
    "OFFLOAD_DIR",
    "SWAP_SUFFIX",
    "aligned_numel",
    "master_file",
    "nvme_optimizer",
    "rank_dir",
    "state_file",
    "swap_id",
    "swappable",
]

OFFLOAD_DIR = "offloaded_tensors"
SWAP_SUFFIX = ".tensor.swp"
MIN_AIO_BYTES = 1024**2  # runtime/swap_tensor/utils.py MIN_AIO_BYTES
AIO_ALIGNED_BYTES = 1024  # runtime/swap_tensor/utils.py AIO_ALIGNED_BYTES
FP32_ITEMSIZE = 4


def _aio(ds_config: Mapping[str, Any] | None) -> Mapping[str, Any]:
    aio = (ds_config or {}).get("aio")
    return aio if isinstance(aio, Mapping) else {}


def nvme_optimizer(ds_config: Mapping[str, Any] | None) -> bool:
    """True when the config swaps ZeRO-3 optimizer state to NVMe."""
    z = (ds_config or {}).get("zero_optimization")
    off = z.get("offload_optimizer") if isinstance(z, Mapping) else None
    return isinstance(off, Mapping) and str(off.get("device", "")).lower() == "nvme"


def swappable(numel: int, ds_config: Mapping[str, Any] | None) -> bool:
    """Whether DeepSpeed swaps an fp32 sub-group partition of ``numel`` elements."""
    block = int(_aio(ds_config).get("block_size", MIN_AIO_BYTES))
    return max(MIN_AIO_BYTES, block) <= numel * FP32_ITEMSIZE


def aligned_numel(numel: int, ds_config: Mapping[str, Any] | None) -> int:
    """The number of fp32 elements DeepSpeed writes for a partition of ``numel`` (I/O alignment)."""
    align = AIO_ALIGNED_BYTES * int(_aio(ds_config).get("intra_op_parallelism", 1)) // FP32_ITEMSIZE
    return -(-numel // align) * align


def rank_dir(rank: int) -> str:
    return f"rank{rank:02d}"


def swap_id(first_ds_id: int, last_ds_id: int) -> str:
    return f"{first_ds_id}_{last_ds_id}"


def master_file(sid: str) -> str:
    return f"{sid}{SWAP_SUFFIX}"


def state_file(key: str, sid: str) -> str:
    return f"{key}-{sid}{SWAP_SUFFIX}"
