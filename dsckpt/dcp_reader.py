"""A PyTorch distributed checkpoint (DCP) folder as a :class:`~dsckpt.model.LogicalCheckpoint`, so ``info``, ``scan``,
``verify``, ``diff`` and ``to-fp32`` read FSDP2, torchtitan, Accelerate and ``to-dcp`` outputs as they read the rest.

A DCP folder (``torch.distributed.checkpoint.FileSystemWriter``, torch 2.x) holds ``.metadata``, a pickle of
``Metadata``: for each flattened key, a tensor's dtype, size and chunks (``offsets``/``sizes`` boxes, one per rank that
saved a shard), or a non-tensor "bytes" item; and for each chunk, the ``.distcp`` file and byte range
(``_StorageInfo``) holding it, one ``torch.save`` stream per chunk. Here

* ``.metadata`` goes through the allow-listed unpickler (:func:`dsckpt.safe_load.load_pickle`; DCP's classes are
  stand-ins, :mod:`dsckpt.stand_ins`) within the read limits, and is checked before anything is read: dtypes and
  shapes, chunks inside their tensor and adding up to it, each byte range a plain file of the folder, inside it, not
  overlapping another;
* each chunk is parsed when first read (:func:`dsckpt.safe_load.load_window`: allow-list, budgets, CRC-32) and must
  hold a tensor of its chunk's dtype and size;
* model tensors are the items under ``model`` (``{"model": ..., "optim": ...}`` as ``to-dcp``, FSDP2 and torchtitan
  save), else every tensor outside ``optim``/``optimizer``; an optimizer state tensor ``optim.state.<fqn>.<key>`` is
  attached to ``<fqn>`` as its optimizer state; bytes items (param groups, Python scalars) are never unpickled.
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from . import safe_load
from .dtypes import DTYPES
from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .limits import regular_file
from .model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry
from .readers.common import FileCache
from .stand_ins import DeepSpeedObject, TorchDtype
from .tensor_ref import TensorRef

__all__ = ["METADATA_NAME", "DcpCache", "is_dcp_folder", "read_dcp"]

METADATA_NAME = ".metadata"
_ITEM = "dcp-item"  # first element of a Fragment key naming a DCP chunk: (_ITEM, offset, nbytes, fqn)
_MODEL_TOPS = ("model",)
_OPTIM_TOPS = ("optim", "optimizer")
_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    p = Path(path)
    return p.is_dir() and (p / METADATA_NAME).is_file()


@dataclass(frozen=True)
class _Chunk:
    fqn: str
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: Path
    offset: int  # byte range of its torch.save stream in ``file``
    nbytes: int


@dataclass(frozen=True)
class _Item:
    fqn: str
    path: tuple[str, ...]  # the key path before DCP flattened it (planner_data), else (fqn,)
    dtype: str
    shape: tuple[int, ...]
    chunks: tuple[_Chunk, ...]


class DcpCache(FileCache):
    """A :class:`FileCache` that also serves the chunks of a DCP folder (Fragment keys ``(_ITEM, offset, nbytes,
    fqn)``), each parsed once, when first read."""

    def __init__(self) -> None:
        super().__init__()
        self._chunks: dict[tuple[Path, int, int], TensorRef] = {}
        self.expect: dict[tuple[Path, int, int], tuple[str, tuple[int, ...]]] = {}

    def tensor(self, path: Path, key: tuple[Any, ...]) -> TensorRef:
        if not key or key[0] != _ITEM:
            return super().tensor(path, key)
        _, offset, nbytes, fqn = key
        where = (path, offset, nbytes)
        if where not in self._chunks:
            obj = safe_load.load_window(path, offset, nbytes)
            dtype, sizes = self.expect[where]
            if not isinstance(obj, TensorRef) or obj.dtype_name != dtype or tuple(obj.shape) != sizes:
                got = (f"{obj.dtype_name} {list(obj.shape)}" if isinstance(obj, TensorRef) else type(obj).__name__)
                raise CorruptCheckpointError(
                    f"{path}: the chunk of '{fqn}' at bytes [{offset}, {offset + nbytes}) holds {got}, and "
                    f".metadata says {dtype} {list(sizes)}; the checkpoint is corrupt")
            self._chunks[where] = obj
        return self._chunks[where]

    def tensor_refs(self) -> Iterator[TensorRef]:
        yield from super().tensor_refs()
        for where in sorted(self._chunks, key=lambda w: (str(w[0]), w[1])):
            yield self._chunks[where]


def _is(obj: Any, name: str) -> bool:
    return isinstance(obj, DeepSpeedObject) and obj.ds_name == name


def _ints(x: Any, what: str) -> tuple[int, ...]:
    if not isinstance(x, (tuple, list)) or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0
                                                    for d in x):
        raise ValueError(f"{what} is {x!r}, not a list of sizes")
    return tuple(int(d) for d in x)


def _properties_dtype(props: Any) -> Any:
    """The dtype of a ``TensorProperties``, which pickles its state as a tuple (dtype, layout, requires_grad,
    memory format, pin_memory) since torch 2.2, as fields before."""
    state = getattr(props, "_state", None)
    if isinstance(state, tuple) and state:
        return state[0]
    return getattr(props, "dtype", None)


def _parse(folder: Path, md: Any) -> tuple[list[_Item], list[str], list[Path]]:
    """The tensor items of ``.metadata`` (checked), the keys of its bytes items, and every data file either
    kind is stored in."""
    md_path = folder / METADATA_NAME
    if not _is(md, "Metadata") or not isinstance(getattr(md, "state_dict_metadata", None), dict) \
            or not isinstance(getattr(md, "storage_data", None), dict):
        raise CorruptCheckpointError(f"{md_path}: not a DCP Metadata record (state_dict_metadata / storage_data "
                                     "missing); this is not a PyTorch distributed checkpoint")
    planner = getattr(md, "planner_data", None)
    planner = planner if isinstance(planner, dict) else {}
    storage: dict[tuple[str, tuple[int, ...] | None], Any] = {}
    for idx, info in md.storage_data.items():
        if not _is(idx, "MetadataIndex") or not _is(info, "_StorageInfo"):
            raise CorruptCheckpointError(f"{md_path}: storage_data holds {type(idx).__name__} -> "
                                         f"{type(info).__name__}; the file is corrupt")
        off = getattr(idx, "offset", None)
        storage[(str(getattr(idx, "fqn", "")), None if off is None else tuple(off))] = info
    problems: list[str] = []
    items: list[_Item] = []
    sizes: dict[str, int] = {}
    spans: dict[Path, list[tuple[int, int, str]]] = {}
    byte_keys: list[str] = []

    def place(fqn: str, offsets: tuple[int, ...] | None) -> tuple[Path, int, int]:
        info = storage.get((fqn, offsets))
        if info is None:
            raise ValueError(f"no storage entry for '{fqn}'" + (f" chunk at {list(offsets)}" if offsets else ""))
        if getattr(info, "transform_descriptors", None):
            raise UnsupportedCheckpointError(
                f"{md_path}: '{fqn}' is stored through DCP extensions {info.transform_descriptors!r} "
                "(compression or another stream transform); dsckpt reads plain DCP folders")
        rel, start, n = getattr(info, "relative_path", None), getattr(info, "offset", None), getattr(info, "length",
                                                                                                    None)
        if not isinstance(rel, str) or Path(rel).name != rel or rel in ("", ".", "..") \
                or not all(isinstance(v, int) and not isinstance(v, bool) for v in (start, n)):
            raise ValueError(f"'{fqn}' has storage {rel!r} at {start!r} ({n!r} bytes)")
        assert isinstance(start, int) and isinstance(n, int)
        file = folder / rel
        if rel not in sizes:
            try:
                sizes[rel] = regular_file(file).st_size
            except FileNotFoundError:
                raise ValueError(f"'{fqn}' is in {rel}, which is missing") from None
        if start < 0 or n <= 0 or start + n > sizes[rel]:
            raise ValueError(f"'{fqn}' is at bytes [{start}, {start + n}) of {rel}, which has {sizes[rel]} bytes")
        spans.setdefault(file, []).append((start, start + n, fqn))
        return file, start, n

    for fqn, meta in md.state_dict_metadata.items():
        try:
            if not isinstance(fqn, str):
                raise ValueError(f"key {fqn!r} is not a string")
            path = planner.get(fqn)
            path = tuple(str(k) for k in path) if isinstance(path, (tuple, list)) and path else (fqn,)
            if _is(meta, "BytesStorageMetadata"):
                place(fqn, None)
                byte_keys.append(fqn)
                continue
            if not _is(meta, "TensorStorageMetadata"):
                raise ValueError(f"'{fqn}' is described by {type(meta).__name__}")
            dtype = _properties_dtype(getattr(meta, "properties", None))
            if not isinstance(dtype, TorchDtype) or dtype.name not in DTYPES:
                raise ValueError(f"'{fqn}' has dtype {dtype!r}")
            shape = _ints(getattr(meta, "size", None), f"the size of '{fqn}'")
            chunks = []
            total = 0
            for ch in getattr(meta, "chunks", None) or ():
                offs = _ints(getattr(ch, "offsets", None), f"a chunk offset of '{fqn}'")
                szs = _ints(getattr(ch, "sizes", None), f"a chunk size of '{fqn}'")
                if len(offs) != len(shape) or len(szs) != len(shape) \
                        or any(o + s > d for o, s, d in zip(offs, szs, shape)):
                    raise ValueError(f"a chunk of '{fqn}' at {list(offs)} of size {list(szs)} is outside its size "
                                     f"{list(shape)}")
                file, start, n = place(fqn, offs)
                chunks.append(_Chunk(fqn, offs, szs, file, start, n))
                total += math.prod(szs)
            if total != math.prod(shape):
                raise ValueError(f"the chunks of '{fqn}' hold {total} elements, its size {list(shape)} "
                                 f"{math.prod(shape)}")
            items.append(_Item(fqn, path, dtype.name, shape, tuple(chunks)))
        except ValueError as e:
            problems.append(str(e))
    for file, sp in spans.items():
        sp.sort()
        for (_, end, a), (start, _, b) in itertools.pairwise(sp):
            if start < end:
                problems.append(f"'{a}' and '{b}' overlap in {file.name}")
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CorruptCheckpointError(f"{md_path}: {'; '.join(problems[:3])}{more}; the .metadata does not match "
                                     "the folder — it is corrupt, or the save did not finish")
    return items, byte_keys, sorted(spans)


def _fragment(item: _Item, ch: _Chunk) -> Fragment:
    """Where chunk ``ch`` lands in the flat tensor: one contiguous range (a row shard, as FSDP2 cuts), or runs of
    rows (a column shard of a 2-D cut)."""
    shape, offs, szs = item.shape, ch.offsets, ch.sizes
    key = (_ITEM, ch.offset, ch.nbytes, item.fqn)
    numel = math.prod(szs)
    d = len(shape)  # the first dim from which the chunk spans every later dim in full
    while d > 0 and all(szs[j] == shape[j] and offs[j] == 0 for j in range(d, len(shape))):
        d -= 1
    # dims [d+1, n) are full: a run is szs[d] * prod(shape[d+1:]) elements; dims before d must be one run apart
    inner = math.prod(shape[d + 1:]) if shape else 1
    start = sum(o * math.prod(shape[j + 1:]) for j, o in enumerate(offs))
    if not shape or d == 0 or all(s == 1 for s in szs[:d]):
        return Fragment(ch.file, key, 0, numel, start)
    if all(s == 1 for s in szs[:d - 1]):
        run = szs[d] * inner
        return Fragment(ch.file, key, 0, numel, start, run_numel=run, dst_stride=shape[d] * inner)
    raise UnsupportedCheckpointError(
        f"{ch.file}: the chunk of '{item.fqn}' at {list(offs)} (size {list(szs)} of {list(shape)}) is cut along "
        "several dims; dsckpt reads DCP tensors cut along one dim")


def read_dcp(path: str | os.PathLike[str]) -> tuple[LogicalCheckpoint, DcpCache]:
    """The DCP folder at ``path`` as a logical checkpoint (see the module docstring); reads ``.metadata`` only."""
    folder = Path(path)
    md = safe_load.load_pickle(folder / METADATA_NAME)
    items, _, data_files = _parse(folder, md)
    cache = DcpCache()
    for it in items:
        for ch in it.chunks:
            cache.expect[(ch.file, ch.offset, ch.nbytes)] = (it.dtype, ch.sizes)
    tops = {it.path[0] for it in items if len(it.path) > 1}
    has_model = bool(tops & set(_MODEL_TOPS))
    models: dict[str, _Item] = {}
    states: dict[str, list[tuple[str, _Item]]] = {}
    for it in items:
        top = it.path[0] if len(it.path) > 1 else None
        if top in _OPTIM_TOPS:
            # ("optim", "state", fqn, key): the FQN may itself hold dots, so take what is between
            if len(it.path) >= 4 and it.path[1] == "state":
                states.setdefault(".".join(it.path[2:-1]), []).append((it.path[-1], it))
            continue
        if has_model and top not in _MODEL_TOPS:
            continue
        name = ".".join(it.path[1:]) if has_model else ".".join(it.path)
        models[name] = it
    entries = []
    for name, it in models.items():
        frags = tuple(_fragment(it, ch) for ch in it.chunks)
        pieces = [Piece(Role.MODULE, it.dtype, frags)]
        for key, st in states.get(name, ()):
            if key == "step" or st.shape != it.shape:
                continue
            pieces.append(Piece(Role.OPTIM_STATE, st.dtype, tuple(_fragment(st, ch) for ch in st.chunks),
                                state_key=key))
        buffer = name.endswith(_BUFFER_SUFFIXES)
        trainable = name in states if states else not buffer
        entries.append(TensorEntry(name, it.shape, Kind.BUFFER if buffer else Kind.PARAM, trainable and not buffer,
                                   tuple(pieces)))
    dtypes = {e.stored_dtype for e in entries}
    precision = (Precision.FP16 if "float16" in dtypes else Precision.BF16 if "bfloat16" in dtypes
                 else Precision.FP32)
    files = tuple(data_files)  # the optimizer's param groups sit in files of bytes items of their own
    logical = LogicalCheckpoint(
        root=folder, tag="", tag_dir=folder, layout="dcp", zero_stage=0, precision=precision, dp_world_size=1,
        pp_world_size=1, tp_world_size=1, ds_version=None, global_steps=None, global_samples=None,
        optimizer_step=None, optimizer_wrapper="torch optimizer (DCP)" if states else "none",
        entries=tuple(entries), files=(folder / METADATA_NAME, *files))
    return logical, cache
