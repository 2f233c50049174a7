"""Consolidated state dicts (what ``to-fp32`` writes, what users keep as trusted fp32 copies), read
lazily and presented as a :class:`~dsckpt.model.LogicalCheckpoint`, so ``scan`` and ``repair`` treat
them like a DeepSpeed checkpoint with one stored copy per tensor.

Supported: one ``.safetensors`` file; a folder of ``*.safetensors`` shards (with or without
``model.safetensors.index.json``); a ``torch.save`` state-dict file (read through
:mod:`dsckpt.safe_load`, never ``torch.load``).
"""

from __future__ import annotations

import enum
import json
import math
import os
import struct
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import parsed_tree, safe_load
from .dcp_reader import is_dcp_folder, read_dcp
from .dtypes import DTYPES, dtype_info
from .errors import CheckpointNotFoundError, CorruptCheckpointError
from .limits import open_parsed, open_regular, read_small_file, remember_parsed
from .model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from .readers.common import FileCache, dtype_name, lookup
from .tensor_ref import SequentialRead, TensorRef, pread_exact

if TYPE_CHECKING:
    import torch

__all__ = [
    "SafetensorsRef",
    "StateDictCache",
    "TargetKind",
    "detect_target",
    "is_bn_buffer_name",
    "open_state_dict",
    "read_safetensors_header",
]

INDEX_NAME = "model.safetensors.index.json"

_ST_DTYPES = {
    "F64": "float64", "F32": "float32", "F16": "float16", "BF16": "bfloat16",
    "I64": "int64", "I32": "int32", "I16": "int16", "I8": "int8", "U8": "uint8", "BOOL": "bool",
}


class TargetKind(enum.Enum):
    DEEPSPEED = "deepspeed"
    SAFETENSORS = "safetensors"
    SAFETENSORS_SHARDED = "safetensors-sharded"
    TORCH = "torch"
    DCP = "dcp"  # a PyTorch distributed checkpoint folder (.metadata + *.distcp; dsckpt.dcp_reader)


def detect_target(path: str | os.PathLike[str]) -> TargetKind:
    """What ``path`` is: a ``.safetensors`` file, a folder of shards, a torch file, a DCP folder (``.metadata``),
    or a DeepSpeed checkpoint (any other folder)."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"'{p}' does not exist")
    if p.is_file():
        return TargetKind.SAFETENSORS if p.suffix.lower() == ".safetensors" else TargetKind.TORCH
    if is_dcp_folder(p):
        return TargetKind.DCP
    if (p / INDEX_NAME).is_file():
        return TargetKind.SAFETENSORS_SHARDED
    if any(p.glob("*.safetensors")) and not (p / "latest").exists() and not any(p.glob("*model_states.pt")):
        return TargetKind.SAFETENSORS_SHARDED
    return TargetKind.DEEPSPEED


def is_bn_buffer_name(name: str) -> bool:
    return name.endswith((".running_mean", ".running_var", ".num_batches_tracked"))


@dataclass(frozen=True, eq=False)
class SafetensorsRef:
    """One tensor of a ``.safetensors`` file, not yet read (same reading interface as TensorRef)."""

    path: Path
    name: str
    dtype_name: str  # "float32", "bfloat16", ...
    shape: tuple[int, ...]
    file_offset: int  # absolute byte offset of the first element

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; use :attr:`dtype_name` on torch-free paths)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * dtype_info(self.dtype_name).itemsize

    def is_contiguous(self) -> bool:
        return True

    def read(self, start: int = 0, numel: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        import torch

        numel = self._check_range(start, numel)
        if out is None:
            out = torch.empty(numel, dtype=self.dtype)
        if numel:
            self._read_bytes(start, numel, out.view(torch.uint8).numpy().data.cast("B"))
        return out

    def read_numpy(self, start: int = 0, numel: int | None = None, *, out: np.ndarray | None = None,
                   fd: int | None = None) -> np.ndarray:
        """Like :meth:`read`, without torch: a 1-D numpy array of the stored bytes' numpy dtype
        (``uint16`` for bfloat16; see :mod:`dsckpt.dtypes`). ``fd``: as for
        :meth:`dsckpt.tensor_ref.TensorRef.read_numpy`."""
        numel = self._check_range(start, numel)
        if out is None:
            out = np.empty(numel, dtype=DTYPES[self.dtype_name].numpy)
        if numel:
            self._read_bytes(start, numel, out.reshape(-1).view(np.uint8).data.cast("B"), fd)
        return out

    def _check_range(self, start: int, numel: int | None) -> int:
        total = self.numel
        if numel is None:
            numel = total - start
        if start < 0 or numel < 0 or start + numel > total:
            raise CorruptCheckpointError(f"{self.path}: asked for elements [{start}, {start + numel}) of "
                                         f"'{self.name}', which has {total}")
        return numel

    def sequential(self, start: int, numel: int, *, fd: int) -> SequentialRead:
        """Elements ``[start, start + numel)`` read front to back in blocks through ``fd``, as
        :meth:`dsckpt.tensor_ref.TensorRef.sequential` (safetensors stores no CRC)."""
        numel = self._check_range(start, numel)
        itemsize = dtype_info(self.dtype_name).itemsize
        return SequentialRead(fd, self.file_offset + start * itemsize, numel, itemsize, self._truncated())

    def _truncated(self) -> str:
        return f"{self.path}: file ends inside tensor '{self.name}'; it is truncated"

    def _read_bytes(self, start: int, numel: int, view: memoryview, fd: int | None = None) -> None:
        itemsize = dtype_info(self.dtype_name).itemsize
        nbytes, offset = numel * itemsize, self.file_offset + start * itemsize
        own = fd is None
        if fd is None:
            fd = open_parsed(self.path)
        try:
            pread_exact(fd, view[:nbytes], offset, self._truncated())
        finally:
            if own:
                os.close(fd)

    def load(self) -> torch.Tensor:
        return self.read().view(self.shape)


def _no_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    keys = [k for k, _ in pairs]
    if len(set(keys)) != len(keys):
        dup = sorted({k for k in keys if keys.count(k) > 1})
        raise ValueError(f"tensor names listed twice: {', '.join(dup)}")
    return dict(pairs)


def read_safetensors_header(path: Path) -> tuple[dict[str, SafetensorsRef], dict[str, str]]:
    """``(name -> SafetensorsRef, __metadata__)`` from a file's JSON header; no tensor data read.

    Checked as the safetensors library does: names unique, known dtypes, non-negative shapes whose
    size matches ``data_offsets``, and offsets that tile the data area in order with no gap, overlap
    or byte past the end of the file."""
    try:
        size = path.stat().st_size
        with os.fdopen(open_regular(path), "rb") as f:
            remember_parsed(path, os.fstat(f.fileno()))
            (n,) = struct.unpack("<Q", f.read(8))
            if n > min(100_000_000, size - 8):
                raise ValueError(f"header length {n} runs past the end of the file ({size} bytes)")
            header = json.loads(f.read(n), object_pairs_hook=_no_duplicates)
        if not isinstance(header, dict):
            raise ValueError("the header is not a JSON object")
        base = 8 + n
        refs: dict[str, SafetensorsRef] = {}
        metadata = header.pop("__metadata__", None) or {}
        if not isinstance(metadata, dict):
            raise ValueError("__metadata__ is not a JSON object")
        spans = []
        for name, info in header.items():
            dtype = _ST_DTYPES[info["dtype"]]
            shape = tuple(int(s) for s in info["shape"])
            if any(s < 0 for s in shape) or not isinstance(info["shape"], list):
                raise ValueError(f"tensor '{name}' has shape {info['shape']!r}")
            start, end = (int(x) for x in info["data_offsets"])
            ref = SafetensorsRef(path, name, dtype, shape, base + start)
            if start < 0 or end - start != ref.nbytes or base + end > size:
                raise ValueError(f"tensor '{name}' does not fit its data_offsets")
            spans.append((start, end, name))
            refs[name] = ref
        pos = 0
        for start, end, name in sorted(spans):
            if start != pos:
                raise ValueError(f"tensor '{name}' starts at byte {start} of the data, expected {pos} "
                                 "(overlapping or gapped data_offsets)")
            pos = end
    except (OSError, ValueError, KeyError, TypeError, AttributeError, struct.error) as e:
        raise CorruptCheckpointError(f"{path}: not a readable .safetensors file ({e})") from e
    return refs, {str(k): str(v) for k, v in metadata.items()}


class StateDictCache(FileCache):
    """A :class:`FileCache` that also serves tensors of ``.safetensors`` files (key = ``(name,)``)."""

    def __init__(self) -> None:
        super().__init__()
        self._st: dict[Path, dict[str, SafetensorsRef]] = {}

    def add_safetensors(self, path: Path) -> dict[str, SafetensorsRef]:
        if path not in self._st:
            self._st[path] = read_safetensors_header(path)[0]
        return self._st[path]

    def tensor(self, path: Path, key: tuple[Any, ...]) -> Any:  # type: ignore[override]
        if path in self._st:
            try:
                return self._st[path][key[0]]
            except (KeyError, IndexError):
                raise CorruptCheckpointError(f"{path}: no tensor {key!r}") from None
        return super().tensor(path, key)

    def is_safetensors(self, path: Path) -> bool:
        return path in self._st


def _shard_files(folder: Path) -> list[Path]:
    index = folder / INDEX_NAME
    if index.is_file():
        try:
            weight_map = json.loads(read_small_file(index).decode("utf-8"))["weight_map"]
            if not isinstance(weight_map, dict) or not all(
                    isinstance(v, str) and v and Path(v).name == v and v not in (".", "..")
                    for v in weight_map.values()):
                raise ValueError("weight_map must map tensor names to shard file names in the same folder")
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise CorruptCheckpointError(f"{index}: unreadable index ({e})") from e
        names = sorted(set(weight_map.values()))
        missing = [n for n in names if not (folder / n).is_file()]
        if missing:
            raise CorruptCheckpointError(f"{index} names shards that are missing: {', '.join(missing)}")
        return [folder / n for n in names]
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise CheckpointNotFoundError(f"'{folder}' holds no .safetensors files")
    return files


def _torch_root(tree: Any) -> tuple[tuple[Any, ...], Any]:
    """Where the state dict is inside a torch file: the top level, or one ``state_dict``/``module``/
    ``model`` entry when that is the only mapping of tensors."""
    if isinstance(tree, Mapping) and not any(isinstance(v, TensorRef) for v in tree.values()):
        for k in ("state_dict", "module", "model"):
            if isinstance(tree.get(k), Mapping):
                return (k,), tree[k]
    return (), tree


def _entry(name: str, file: Path, key: tuple[Any, ...], ref: Any) -> TensorEntry:
    kind = Kind.BUFFER if is_bn_buffer_name(name) else Kind.PARAM
    piece = Piece(Role.MODULE, dtype_name(ref.dtype_name), (Fragment(file, key, 0, ref.numel, 0),))
    return TensorEntry(name, tuple(ref.shape), kind, kind is Kind.PARAM, (piece,))


def open_state_dict(path: str | os.PathLike[str]) -> tuple[LogicalCheckpoint, FileCache]:
    """A consolidated state dict as a logical checkpoint: one MODULE piece per tensor.

    Tensors sharing one view in a torch file (tied weights) become alias entries. A DCP folder: see
    :func:`dsckpt.dcp_reader.read_dcp` (optimizer state tensors are attached to their params).
    """
    p = Path(path)
    kind = detect_target(p)
    if kind is TargetKind.DCP:
        return read_dcp(p)
    cache = StateDictCache()
    entries: list[TensorEntry] = []
    if kind is TargetKind.DEEPSPEED:
        raise CheckpointNotFoundError(f"'{p}' is a DeepSpeed checkpoint folder, not a consolidated state dict")
    if kind in (TargetKind.SAFETENSORS, TargetKind.SAFETENSORS_SHARDED):
        files = [p] if kind is TargetKind.SAFETENSORS else _shard_files(p)
        seen: dict[str, Path] = {}
        for f in files:
            for name, ref in cache.add_safetensors(f).items():
                if name in seen:
                    raise CorruptCheckpointError(f"tensor '{name}' is in both {seen[name].name} and {f.name}")
                seen[name] = f
                entries.append(_entry(name, f, (name,), ref))
    else:
        files = [p]
        tree = safe_load.load(p)
        if not isinstance(tree, Mapping):
            raise CorruptCheckpointError(f"{p}: expected a state dict (a mapping of tensors), found "
                                         f"{type(tree).__name__}")
        cache._trees[p] = tree  # prime the parse cache with the tree we already have
        prefix, _ = _torch_root(tree)
        first_view: dict[tuple[Any, ...], str] = {}
        by_name: dict[str, TensorEntry] = {}
        for key, tref in parsed_tree.walk_tensors(lookup(tree, prefix, p), prefix):
            name = ".".join(str(k) for k in key[len(prefix):])
            view = (tref.storage.key, tref.storage_offset, tref.shape, tref.stride)
            if view in first_view and tref.numel:
                src = by_name[first_view[view]]
                e = TensorEntry(name, src.shape, src.kind, src.trainable, src.pieces, tied_to=src.name)
            else:
                first_view[view] = name
                e = _entry(name, p, key, tref)
            by_name[name] = e
            entries.append(e)
    dtypes = {e.stored_dtype for e in entries}
    precision = (Precision.FP16 if dtypes & {"float16"} else Precision.BF16 if dtypes & {"bfloat16"}
                 else Precision.FP32)
    root = p if p.is_dir() else p.parent
    logical = LogicalCheckpoint(
        root=root, tag="", tag_dir=root, layout=kind.value, zero_stage=0, precision=precision,
        dp_world_size=1, pp_world_size=1, tp_world_size=1, ds_version=None, global_steps=None,
        global_samples=None, optimizer_step=None, optimizer_wrapper="none", entries=tuple(entries),
        files=tuple(files),
    )
    return logical, cache
