"""Streaming safetensors writer: the header is computed from the plan and written first, then each
tensor's bytes are written as it is produced, so only one tensor is in memory at a time.

Format (https://huggingface.co/docs/safetensors): 8-byte little-endian header length, a JSON header
padded with spaces to a multiple of 8, then the tensor bytes back to back.
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

import numpy as np

from ..atomic import atomic_file, verification_failed
from ..dtypes import dtype_info

if TYPE_CHECKING:
    import torch

#: A piece of tensor data: a numpy array holding the spec's dtype bytes (uint16 for bfloat16; see
#: dsckpt.dtypes) or a torch tensor of the spec's dtype.
Chunk = Union[np.ndarray, "torch.Tensor"]

__all__ = [
    "ShardPlan",
    "TensorSpec",
    "chunk_bytes",
    "header_bytes",
    "plan_shards",
    "verify_safetensors",
    "write_safetensors",
    "write_safetensors_chunks",
    "write_shard_index",
    "write_sharded",
    "write_sharded_chunks",
]

_SAFETENSORS_DTYPES = ("F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U8", "BOOL")


@dataclass(frozen=True)
class TensorSpec:
    """One output tensor. ``dtype`` is a name (``"float32"``); a ``torch.dtype`` is accepted and
    stored as its name."""

    name: str
    dtype: str
    shape: tuple[int, ...]

    def __post_init__(self) -> None:
        object.__setattr__(self, "dtype", dtype_info(self.dtype).name)
        object.__setattr__(self, "shape", tuple(int(d) for d in self.shape))

    @property
    def code(self) -> str:
        return dtype_info(self.dtype).safetensors

    @property
    def nbytes(self) -> int:
        n = dtype_info(self.dtype).itemsize
        for s in self.shape:
            n *= s
        return n


@dataclass(frozen=True)
class ShardPlan:
    """Which tensors go to which file; ``filenames[i]`` holds ``shards[i]``."""

    filenames: tuple[str, ...]
    shards: tuple[tuple[TensorSpec, ...], ...]

    @property
    def total_nbytes(self) -> int:
        return sum(s.nbytes for shard in self.shards for s in shard)

    @property
    def name_to_file(self) -> dict[str, str]:
        return {s.name: f for f, shard in zip(self.filenames, self.shards) for s in shard}


def plan_shards(specs: Sequence[TensorSpec], max_shard_nbytes: int | None,
                *, prefix: str = "model") -> ShardPlan:
    """Cut ``specs`` into shards of at most ``max_shard_nbytes``, exactly as huggingface_hub's
    ``split_torch_state_dict_into_shards`` does (and so ``save_pretrained``): tensors in order fill
    the current shard until the next would overflow it; a tensor larger than the limit gets a shard
    of its own, placed when it is met, and the current shard goes on after it. One shard ->
    ``model.safetensors``, else ``model-00001-of-0000N.safetensors``."""
    shards: list[list[TensorSpec]] = []
    current: list[TensorSpec] = []
    size = 0
    for spec in specs:
        if max_shard_nbytes is not None and spec.nbytes > max_shard_nbytes:
            shards.append([spec])
            continue
        if max_shard_nbytes is not None and size + spec.nbytes > max_shard_nbytes:
            shards.append(current)
            current, size = [], 0
        current.append(spec)
        size += spec.nbytes
    if current or not shards:
        shards.append(current)
    n = len(shards)
    names: tuple[str, ...]
    if n == 1:
        names = (f"{prefix}.safetensors",)
    else:
        names = tuple(f"{prefix}-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n))
    return ShardPlan(names, tuple(tuple(s) for s in shards))


def header_bytes(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    """The first bytes of the file :func:`write_safetensors_chunks` writes for ``specs``: 8-byte length
    and JSON header; tensor ``i``'s bytes follow at ``len(header) + sum(nbytes of specs[:i])``. Pure."""
    return _header(specs, metadata)


def chunk_bytes(t: Any, spec: TensorSpec) -> memoryview:
    """The raw bytes of a chunk produced for ``spec`` (numpy or torch), checked against its dtype."""
    return _chunk_bytes(t, spec)


def _header(specs: Sequence[TensorSpec], metadata: dict[str, str] | None) -> bytes:
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in metadata.items()}
    offset = 0
    for spec in specs:
        if spec.code not in _SAFETENSORS_DTYPES:
            raise ValueError(f"safetensors cannot store dtype {spec.dtype} (tensor '{spec.name}')")
        header[spec.name] = {"dtype": spec.code, "shape": list(spec.shape),
                             "data_offsets": [offset, offset + spec.nbytes]}
        offset += spec.nbytes
    raw = json.dumps(header, separators=(",", ":")).encode("utf-8")
    raw += b" " * (-len(raw) % 8)
    return len(raw).to_bytes(8, "little") + raw


def write_safetensors(path: str | os.PathLike[str], specs: Sequence[TensorSpec],
                      produce: Callable[[TensorSpec], Chunk], *,
                      metadata: dict[str, str] | None = None,
                      on_tensor: Callable[[TensorSpec], None] | None = None) -> Path:
    """Write ``specs`` to ``path`` atomically, asking ``produce`` for each tensor in turn."""
    return write_safetensors_chunks(path, specs, _whole(produce), metadata=metadata, on_tensor=on_tensor)


def write_safetensors_chunks(path: str | os.PathLike[str], specs: Sequence[TensorSpec],
                             produce_chunks: Callable[[TensorSpec], Iterable[Chunk]], *,
                             metadata: dict[str, str] | None = None,
                             on_tensor: Callable[[TensorSpec], None] | None = None,
                             on_bytes: Callable[[memoryview], None] | None = None,
                             make_parent: bool = True) -> Path:
    """Like :func:`write_safetensors`, but each tensor comes as consecutive pieces: ``produce_chunks``
    yields chunks of the spec's dtype whose bytes, concatenated, are the tensor (row-major). Each
    piece is written before the next is asked for, so it may be a view into a reused buffer.
    ``on_bytes`` sees every byte written, in file order (a CRC-32 of the file as it is written);
    ``make_parent``: see :func:`dsckpt.atomic.atomic_file`."""
    path = Path(path)
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        raise ValueError("duplicate tensor names")
    with atomic_file(path, make_parent=make_parent, check=lambda tmp: verify_safetensors(tmp, specs, target=path)) as f:
        header = _header(specs, metadata)
        if on_bytes is not None:
            on_bytes(memoryview(header))
        f.write(header)
        f.flush()
        fd = f.fileno()
        pos = kicked = len(header)
        for spec in specs:
            written = 0
            for t in produce_chunks(spec):
                data = _chunk_bytes(t, spec)
                if len(data):
                    if on_bytes is not None:
                        on_bytes(data)
                    n = _write_all(fd, data)
                    written += n
                    pos += n
                    if pos - kicked >= WRITEBACK_KICK_NBYTES:
                        _start_writeback(fd, kicked, pos)
                        kicked = pos
            if written != spec.nbytes:
                raise AssertionError(f"{spec.name}: produced {written} bytes, planned {spec} ({spec.nbytes} bytes)")
            if on_tensor is not None:
                on_tensor(spec)
    return path


def _chunk_bytes(t: Any, spec: TensorSpec) -> memoryview:
    """The raw bytes of a numpy or torch chunk, checked against the spec's dtype."""
    if isinstance(t, np.ndarray):
        if t.dtype != np.dtype(dtype_info(spec.dtype).numpy):
            raise AssertionError(f"{spec.name}: produced numpy {t.dtype}, planned {spec}")
        return np.ascontiguousarray(t).reshape(-1).view(np.uint8).data
    import torch

    if str(t.dtype).removeprefix("torch.") != spec.dtype:
        raise AssertionError(f"{spec.name}: produced {t.dtype}, planned {spec}")
    return memoryview(t.contiguous().reshape(-1).view(torch.uint8).numpy())


def _whole(produce: Callable[[TensorSpec], Chunk]) -> Callable[[TensorSpec], Iterable[Chunk]]:
    def chunks(spec: TensorSpec) -> Iterable[Chunk]:
        t = produce(spec)
        if tuple(t.shape) != spec.shape:
            raise AssertionError(f"{spec.name}: produced shape {list(t.shape)}, planned {spec}")
        return (t,)

    return chunks


# Every this many bytes written, ask the kernel to start writing them to disk.
WRITEBACK_KICK_NBYTES = 16 << 20


def _start_writeback(fd: int, start: int, end: int) -> None:
    """Start asynchronous write-back of bytes ``[start, end)`` of ``fd``.

    Without it a file smaller than the dirty-page limit (10% of RAM: 12.8 GB on a 128 GB host) is
    written to disk only by the final fsync, after all the reading and converting: the disk idles,
    then the CPU does. Linux: ``POSIX_FADV_DONTNEED`` on dirty pages starts their write-back and drops
    only pages already clean (the previous kick's), so the fsync has little left to wait for."""
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, start, end - start, os.POSIX_FADV_DONTNEED)


def _write_all(fd: int, data: memoryview) -> int:
    # os.write, not the buffered file: the bytes go straight from the tensor to the kernel.
    done = 0
    while done < len(data):
        done += os.write(fd, data[done:])
    return done


def write_sharded(directory: Path, plan: ShardPlan, produce: Callable[[TensorSpec], Chunk], *,
                  metadata: dict[str, str] | None = None,
                  on_tensor: Callable[[TensorSpec], None] | None = None) -> list[Path]:
    """Write every shard of ``plan`` into ``directory``, plus ``model.safetensors.index.json`` when
    there is more than one shard."""
    return write_sharded_chunks(directory, plan, _whole(produce), metadata=metadata, on_tensor=on_tensor)


def write_sharded_chunks(directory: Path, plan: ShardPlan,
                         produce_chunks: Callable[[TensorSpec], Iterable[Chunk]], *,
                         metadata: dict[str, str] | None = None,
                         on_tensor: Callable[[TensorSpec], None] | None = None) -> list[Path]:
    """:func:`write_sharded` with tensors produced in pieces, as in :func:`write_safetensors_chunks`.
    Shards are written in order, tensors in plan order."""
    written = []
    for filename, shard in zip(plan.filenames, plan.shards):
        written.append(write_safetensors_chunks(directory / filename, shard, produce_chunks, metadata=metadata,
                                                on_tensor=on_tensor))
    if len(plan.filenames) > 1:
        written.append(write_shard_index(directory, plan, metadata=metadata))
    return written


def write_shard_index(directory: Path, plan: ShardPlan, *, metadata: dict[str, str] | None = None) -> Path:
    """``model.safetensors.index.json`` for a plan of several shards, as save_pretrained writes it:
    {"metadata": {"total_size": <tensor bytes>, ...}, "weight_map": ...}, keys sorted."""
    index = {"metadata": {**(metadata or {}), "total_size": plan.total_nbytes},
             "weight_map": plan.name_to_file}
    index_path = directory / "model.safetensors.index.json"
    with atomic_file(index_path) as f:
        f.write(json.dumps(index, indent=2, sort_keys=True).encode("utf-8") + b"\n")
    return index_path


def verify_safetensors(path: Path, specs: Sequence[TensorSpec], *, target: Path | None = None) -> None:
    """Reopen ``path`` with the safetensors library and check names, shapes and dtypes. For a file not yet
    moved into place: errors (:func:`dsckpt.atomic.verification_failed`) name it ``target`` (default ``path``)."""
    from safetensors import SafetensorError, safe_open

    target = path if target is None else target
    try:
        f = safe_open(str(path), framework="numpy")
    except (SafetensorError, OSError) as e:
        raise verification_failed(target, f"the written file cannot be reopened ({e})") from e
    with f:
        keys = set(f.keys())
        if keys != {s.name for s in specs}:
            raise verification_failed(target, "the written file lists other tensors than planned")
        for spec in specs:
            sl = f.get_slice(spec.name)
            if tuple(sl.get_shape()) != spec.shape or sl.get_dtype() != spec.code:
                raise verification_failed(target, f"'{spec.name}' was not written as planned")
