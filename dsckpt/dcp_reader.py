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
  save), else every tensor outside ``optim``/``optimizer``; an optimizer state tensor ``optim.state.<fqn>.<key>`` of
  its param's shape is attached to ``<fqn>`` as its optimizer state;
* the optimizer side (:func:`describe_dcp`, issue 40: what a writer of another layout needs) is read as
  ``get_state_dict`` saves it, nested (``optim.param_groups.<i>.<key>``, ``params`` the FQNs) or flattened
  (``optim.param_groups.<fqn>.<key>``): each param's ``step`` (a 0-dim tensor, or a Python number), every group
  and its hyper-parameters; its non-tensor items go through the same allow-listed unpickler, one at a time, within
  the read limits (``max_dcp_values`` of them); it is checked against the model state and refused by key where
  they disagree;
* a Trainer ``checkpoint-N/`` or an Accelerate ``save_state`` folder saved under FSDP is one source made of its
  ``pytorch_model_fsdp_0/`` (``{"model": M}``) and ``optimizer_0/`` (``{"optimizer": O}``) folders
  (:func:`dcp_folders`).

What a DCP folder cannot say, and is therefore not made up: the model's precision beyond the stored dtypes (a model
trained in bf16 without fp32 masters saves bf16 tensors, which are then the most precise copy), which params of a
model-only folder were trained, a tie between two frozen params, and, for a multi-rank save, the module's order
(``.metadata`` lists the sharded items before those DCP de-duplicated).
"""

from __future__ import annotations

import enum
import itertools
import json
import math
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import limits, safe_load
from .dtypes import DTYPES
from .errors import CorruptCheckpointError, DsckptError, UnsupportedCheckpointError
from .limits import read_small_file, regular_file
from .model import Fragment, Kind, LogicalCheckpoint, OptimizerGroup, Piece, Precision, Role, TensorEntry
from .readers.common import FileCache, alias_entry
from .stand_ins import DeepSpeedObject, TorchDtype
from .tensor_ref import TensorRef

__all__ = ["FSDP_MODEL_FOLDER", "FSDP_OPTIM_FOLDER", "METADATA_NAME", "DcpCache", "DcpOptimizer", "DcpOptimizerFormat",
           "DcpParamState", "DcpSource", "dcp_folders", "describe_dcp", "is_dcp_folder", "optimizer_class_of",
           "read_dcp"]

METADATA_NAME = ".metadata"
#: accelerate 1.15 utils/constants.py: FSDP_MODEL_NAME, OPTIMIZER_NAME; index 0 (one model, one optimizer): the DCP
#: folders of a Trainer checkpoint-N/ or an Accelerate save_state folder saved under FSDP. The names
#: dsckpt.run_folder_dcp writes (MODEL_FOLDER, OPTIM_FOLDER; tests/test_dcp_reader.py holds them equal), not imported
#: from there: run_folder_dcp imports the DCP writer, whose importers import this module (a cycle)
FSDP_MODEL_FOLDER = "pytorch_model_fsdp_0"
FSDP_OPTIM_FOLDER = "optimizer_0"
_ITEM = "dcp-item"  # first element of a Fragment key naming a DCP chunk: (_ITEM, offset, nbytes, fqn)
_MODEL_TOPS = ("model",)
_OPTIM_TOPS = ("optim", "optimizer")
_BUFFER_SUFFIXES = (".running_mean", ".running_var", ".num_batches_tracked")


def dcp_folders(path: str | os.PathLike[str]) -> tuple[Path, ...] | None:
    """The DCP folders ``path`` is made of: itself (it holds ``.metadata``), or for a Trainer ``checkpoint-N/`` or an
    Accelerate ``save_state`` folder saved under FSDP (``pytorch_model_fsdp_0/``, and ``optimizer_0/`` when the
    optimizer was saved; no DeepSpeed ``latest``) those two; None for anything else."""
    p = Path(path)
    if not p.is_dir():
        return None
    if (p / METADATA_NAME).is_file():
        return (p,)
    if (p / FSDP_MODEL_FOLDER / METADATA_NAME).is_file() and not (p / "latest").exists():
        return (p / FSDP_MODEL_FOLDER, *((p / FSDP_OPTIM_FOLDER,) if (p / FSDP_OPTIM_FOLDER).exists() else ()))
    return None


def is_dcp_folder(path: str | os.PathLike[str]) -> bool:
    """A DCP folder, or a run folder of them (:func:`dcp_folders`)."""
    return dcp_folders(path) is not None


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


@dataclass(frozen=True)
class _Bytes:
    """A non-tensor item: one ``torch.save`` stream of a Python value at bytes ``[offset, offset + nbytes)``."""

    fqn: str
    path: tuple[str, ...]
    file: Path
    offset: int
    nbytes: int


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


def _parse(folder: Path, md: Any) -> tuple[list[_Item], list[_Bytes], list[Path]]:
    """The tensor items of ``.metadata`` (checked), its bytes items (where each is stored), and every data file
    either kind is stored in."""
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
    byte_items: list[_Bytes] = []

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
                byte_items.append(_Bytes(fqn, path, *place(fqn, None)))
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
    return items, byte_items, sorted(spans)


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


# --------------------------------------------------------------------------------------------
# the optimizer side: what a writer of another layout needs (issue 40)


class DcpOptimizerFormat(enum.Enum):
    """How ``get_state_dict`` laid out the optimizer state dict that was saved."""

    #: the default: ``optim.state.<fqn>.<key>`` and ``optim.param_groups.<i>.<key>`` (``params``: the FQNs), so the
    #: groups, their order and their params' order are as the optimizer held them
    NESTED = "nested"
    #: ``StateDictOptions(flatten_optimizer_state_dict=True)``: ``optim.state.<fqn>.<key>`` and
    #: ``optim.param_groups.<fqn>.<key>``, each param's hyper-parameters; which params shared a group is not saved
    FLATTENED = "flattened"


@dataclass(frozen=True)
class DcpParamState:
    """One param's optimizer state as saved under ``<optim>.state.<name>``.

    ``step``: as saved, a float for torch's 0-dim float32 tensor (``step_dtype`` "float32"), an int or float for a
    Python number (``step_dtype`` None), None when the state holds no ``step``. ``state_keys``: the per-element state
    tensors (the param's shape), in the saved order, attached to the param's :class:`TensorEntry` as
    :attr:`Role.OPTIM_STATE` pieces. ``other``: every other state item, ``(key, value)``, a Python value as saved,
    or for a tensor of another shape ``("tensor", dtype, shape)``; a writer that cannot carry one must refuse it."""

    name: str
    step: int | float | None
    step_dtype: str | None
    state_keys: tuple[str, ...]
    other: tuple[tuple[str, Any], ...] = ()


@dataclass(frozen=True)
class DcpOptimizer:
    """The optimizer side of a DCP folder. ``key``: the top-level key it sits under (``optim``, ``optimizer``).
    ``params``: every param the state names, in the saved order. ``groups`` (also ``LogicalCheckpoint.
    optimizer_groups``): each group's FQNs in the optimizer's order, ``step`` None (torch keeps it per param), every
    hyper-parameter as saved (``betas`` a tuple), ``params`` left out. ``groups_saved``: False for the flattened
    layout, whose groups are rebuilt here from equal hyper-parameters, in the order their first param appears in the
    state (two groups with equal hyper-parameters become one). ``optimizer_class``: the ``torch.optim`` class the
    group keys and state keys point to (:func:`optimizer_class_of`), None when they do not tell."""

    key: str
    format: DcpOptimizerFormat
    params: tuple[DcpParamState, ...]
    groups: tuple[OptimizerGroup, ...]
    groups_saved: bool
    optimizer_class: str | None

    def param(self, name: str) -> DcpParamState | None:
        return next((p for p in self.params if p.name == name), None)

    @property
    def steps(self) -> dict[str, int | float | None]:
        """``name -> step`` of every param with state."""
        return {p.name: p.step for p in self.params}


@dataclass(frozen=True)
class DcpSource:
    """A DCP folder described for every command: the :class:`LogicalCheckpoint` (model tensors as
    :attr:`Role.MODULE` pieces in the stored dtype, per-element optimizer states attached by FQN, ties proven by
    value, the optimizer's groups, step and class), the cache that reads its chunks, and the optimizer side
    (``optimizer`` None: a model-only folder, no optimizer state at all)."""

    logical: LogicalCheckpoint
    cache: DcpCache
    optimizer: DcpOptimizer | None
    model_key: str | None  # the top-level key of the model tensors ("model"), None: the keys are the FQNs

    @property
    def model_only(self) -> bool:
        return self.optimizer is None


def optimizer_class_of(group_keys: set[str] | frozenset[str], state_keys: set[str] | frozenset[str],
                       hyperparams: dict[str, Any]) -> str | None:
    """The ``torch.optim`` class a saved group's keys (and its params' state keys) point to, or None. torch 2.13's
    Adam and AdamW groups have the same keys; ``decoupled_weight_decay`` tells them apart (older torch saved none:
    then None, not a guess)."""
    if {"betas", "eps", "amsgrad"} <= group_keys and state_keys <= {"step", "exp_avg", "exp_avg_sq",
                                                                      "max_exp_avg_sq"}:
        if "decoupled_weight_decay" not in hyperparams:
            return None
        return "AdamW" if hyperparams["decoupled_weight_decay"] is True else "Adam"
    if {"momentum", "dampening", "nesterov"} <= group_keys and state_keys <= {"momentum_buffer"}:
        return "SGD"
    if {"lr_decay", "initial_accumulator_value"} <= group_keys and state_keys <= {"step", "sum"}:
        return "Adagrad"
    if {"alpha", "centered", "momentum"} <= group_keys and state_keys <= {"step", "square_avg", "momentum_buffer",
                                                                        "grad_avg"}:
        return "RMSprop"
    return None


def _optim_path(path: tuple[str, ...]) -> tuple[str, str, str] | None:
    """``(section, middle, key)`` of an optimizer item below its top key: section ``state`` (middle: the FQN) or
    ``param_groups`` (middle: the group index in the nested layout, the FQN in the flattened one, which DCP keeps as
    one path element ``"state.<fqn>.<key>"``); None for anything else."""
    if len(path) >= 4 and path[1] in ("state", "param_groups"):
        return path[1], ".".join(path[2:-1]), path[-1]
    if len(path) == 2:
        for section in ("state", "param_groups"):
            rest = path[1].removeprefix(section + ".")
            if rest != path[1] and "." in rest:
                middle, _, key = rest.rpartition(".")
                return section, middle, key
    return None


def _number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _hyper_value(v: Any) -> bool:
    """A hyper-parameter value a param group holds: None, bool, number, string, or a tuple/list of those."""
    if v is None or isinstance(v, (bool, int, float, str)):
        return True
    return isinstance(v, (tuple, list)) and len(v) <= 64 and all(x is None or isinstance(x, (bool, int, float, str))
                                                                 for x in v)


def _same_values(a: TensorEntry, b: TensorEntry, cache: DcpCache) -> bool:
    """Whether the stored module copies of ``a`` and ``b`` (same shape and dtype) hold the same bytes: chunk by chunk
    where both are cut alike (each chunk's record CRC-32 first: a chunk stored alone in its record with another
    CRC differs, and no byte is read), else the whole tensors."""
    pa, pb = a.piece(Role.MODULE), b.piece(Role.MODULE)
    assert pa is not None and pb is not None
    fa, fb = sorted(pa.fragments, key=lambda f: f.dst_offset), sorted(pb.fragments, key=lambda f: f.dst_offset)
    if [(f.dst_offset, f.numel, f.run_numel, f.dst_stride) for f in fa] == \
            [(f.dst_offset, f.numel, f.run_numel, f.dst_stride) for f in fb]:
        refs = [(cache.tensor(x.file, x.key), cache.tensor(y.file, y.key)) for x, y in zip(fa, fb)]
        for ra, rb in refs:
            sa, sb = ra.storage, rb.storage
            if sa.numel == ra.numel and sb.numel == rb.numel and sa.crc32 is not None and sb.crc32 is not None \
                    and sa.crc32 != sb.crc32:
                return False
        return all(ra.read_numpy().tobytes() == rb.read_numpy().tobytes() for ra, rb in refs)
    import torch

    from .assemble import read_piece

    x, y = read_piece(pa, a.shape, cache, name=a.name), read_piece(pb, b.shape, cache, name=b.name)
    return torch.equal(x.reshape(-1).view(torch.uint8), y.reshape(-1).view(torch.uint8))


def _trainer_global_step(folder: Path) -> int | None:
    """``global_step`` of the Trainer's ``trainer_state.json`` beside the DCP folders (a Trainer ``checkpoint-N/``),
    read within the small-file budget; None when there is none or it holds no integer step."""
    path = folder / "trainer_state.json"
    if not path.is_file():
        return None
    try:
        state = json.loads(read_small_file(path).decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise CorruptCheckpointError(f"{path}: not JSON ({e}); the Trainer's state is damaged") from e
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and not isinstance(step, bool) and step >= 0 else None


@dataclass
class _Sections:
    """The items of a DCP source sorted by what they are: model tensors by FQN; optimizer items by param FQN
    (``states``) and by group index, or FQN in the flattened layout (``group_items``), each ``[(key, item)]`` in
    the saved order."""

    folder: Path
    parts: tuple[Path, ...]
    md_paths: list[Path]
    data_files: list[Path]
    model_top: str | None
    optim_top: str | None
    fmt: DcpOptimizerFormat | None
    models: dict[str, _Item] = field(default_factory=dict)
    states: dict[str, list[tuple[str, _Item | _Bytes]]] = field(default_factory=dict)
    group_items: dict[str, list[tuple[str, _Item | _Bytes]]] = field(default_factory=dict)

    @property
    def state_prefix(self) -> str:
        return f"{self.optim_top}.state." if self.optim_top else ""

    @property
    def groups_prefix(self) -> str:
        return f"{self.optim_top}.param_groups." if self.optim_top else ""

    @property
    def files(self) -> tuple[Path, ...]:
        """Each part's ``.metadata``, then its data files."""
        return tuple(p for md_path, part in zip(self.md_paths, self.parts)
                     for p in (md_path, *(f for f in self.data_files if f.parent == part)))


def _sections(folder: Path, cache: DcpCache) -> _Sections:
    """Parse the ``.metadata`` of every part of ``folder`` (checked, :func:`_parse`), tell the chunks' expected
    dtypes and sizes to ``cache``, and sort the items."""
    parts = dcp_folders(folder) or (folder,)
    items: list[_Item] = []
    byte_items: list[_Bytes] = []
    data_files: list[Path] = []
    md_paths = []
    for part in parts:
        md_path = part / METADATA_NAME
        if not md_path.is_file():
            raise CorruptCheckpointError(f"{part}: no {METADATA_NAME}; the DCP save of this folder did not finish "
                                         "(or the folder is not a DCP folder)")
        part_items, part_bytes, part_files = _parse(part, safe_load.load_pickle(md_path))
        items += part_items
        byte_items += part_bytes
        data_files += part_files
        md_paths.append(md_path)
    for it in items:
        for ch in it.chunks:
            cache.expect[(ch.file, ch.offset, ch.nbytes)] = (it.dtype, ch.sizes)
    every: list[_Item | _Bytes] = [*items, *byte_items]
    tops = {it.path[0] for it in every if len(it.path) > 1}
    sec = _Sections(folder, parts, md_paths, data_files, next((t for t in _MODEL_TOPS if t in tops), None),
                    next((t for t in _OPTIM_TOPS if t in tops), None), None)
    for any_item in every:
        top = any_item.path[0] if len(any_item.path) > 1 else None
        if top is not None and top == sec.optim_top:
            where = _optim_path(any_item.path)
            if where is None:
                continue
            section, middle, key = where
            if section == "param_groups":
                sec.fmt = DcpOptimizerFormat.NESTED if len(any_item.path) >= 4 else DcpOptimizerFormat.FLATTENED
                sec.group_items.setdefault(middle, []).append((key, any_item))
            else:
                sec.states.setdefault(middle, []).append((key, any_item))
            continue
        if top in _OPTIM_TOPS or not isinstance(any_item, _Item):
            continue
        if sec.model_top is not None and top != sec.model_top:
            continue
        name = ".".join(any_item.path[1:]) if sec.model_top is not None else ".".join(any_item.path)
        sec.models[name] = any_item
    return sec


class _Values:
    """Reads the optimizer's non-tensor values (each bytes item through the allow-listed unpickler; one-element
    tensors through the cache) and collects the problems found, to be raised together."""

    def __init__(self, cache: DcpCache) -> None:
        self.cache = cache
        self.problems: list[str] = []

    def value(self, b: _Bytes) -> Any:
        try:
            return safe_load.load_window(b.file, b.offset, b.nbytes)
        except DsckptError as e:  # the same refusal, naming the item
            try:
                named = type(e)(f"'{b.fqn}' (a non-tensor item): {e}")
            except TypeError:
                named = CorruptCheckpointError(f"'{b.fqn}' (a non-tensor item): {e}")
            raise named from e

    def scalar(self, it: _Item | _Bytes, what: str) -> Any:
        """A bytes item's Python value, or a one-element tensor item's value."""
        if isinstance(it, _Bytes):
            return self.value(it)
        if math.prod(it.shape) != 1 or len(it.chunks) != 1:
            self.problems.append(f"'{it.fqn}' ({what}) is a tensor of size {list(it.shape)}, not one number")
            return None
        ch = it.chunks[0]
        return self.cache.tensor(ch.file, (_ITEM, ch.offset, ch.nbytes, it.fqn)).item()


def _param_states(sec: _Sections, vals: _Values) -> tuple[list[DcpParamState], dict[str, list[tuple[str, _Item]]]]:
    """Each param's state as saved, and the per-element state tensors to attach to each FQN."""
    if sec.states and sec.models and all(k.isdigit() and k not in sec.models for k in sec.states):
        # dcp.save({"optim": optimizer.state_dict()}): torch's own state dict numbers the params; which number is
        # which param is the optimizer's construction order, which the folder does not record
        raise UnsupportedCheckpointError(
            f"{sec.folder}: the optimizer state is keyed by index ('{sec.state_prefix}{next(iter(sec.states))}.…'), "
            "as optimizer.state_dict() numbers params, not by name as get_state_dict / get_optimizer_state_dict "
            "save it; which index is which param is not recorded, and dsckpt does not guess. Save with "
            "torch.distributed.checkpoint.state_dict.get_state_dict(model, optimizer)")
    param_states: list[DcpParamState] = []
    attached: dict[str, list[tuple[str, _Item]]] = {}
    for fqn, kv in sec.states.items():
        model_item = sec.models.get(fqn)
        if model_item is None and sec.models:
            vals.problems.append(f"'{sec.state_prefix}{fqn}.{kv[0][0]}': the optimizer state names '{fqn}', which "
                                 "the model state lacks")
            continue
        step: int | float | None = None
        step_dtype: str | None = None
        keys: list[str] = []
        other: list[tuple[str, Any]] = []
        for key, st_item in kv:
            if key == "step":
                step = vals.scalar(st_item, "a step")
                step_dtype = st_item.dtype if isinstance(st_item, _Item) else None
                if step is not None and not _number(step):
                    vals.problems.append(f"'{st_item.fqn}': the step is {type(step).__name__} {step!r}, not a "
                                         "number")
                    step = None
            elif isinstance(st_item, _Item) and (model_item is None or st_item.shape == model_item.shape):
                keys.append(key)
                attached.setdefault(fqn, []).append((key, st_item))
            elif isinstance(st_item, _Item):
                other.append((key, ("tensor", st_item.dtype, st_item.shape)))
            else:
                other.append((key, vals.value(st_item)))
        param_states.append(DcpParamState(fqn, step, step_dtype, tuple(keys), tuple(other)))
    return param_states, attached


def _hyperparams(kv: list[tuple[str, _Item | _Bytes]], where: str, vals: _Values) -> list[tuple[str, Any]]:
    hp: list[tuple[str, Any]] = []
    for k, hp_item in kv:
        if k == "params":
            continue
        v = vals.scalar(hp_item, "a hyper-parameter")
        if not _hyper_value(v):
            vals.problems.append(f"'{where}.{k}' holds {type(v).__name__}, not a hyper-parameter")
            v = repr(v)
        hp.append((k, v))
    return hp


def _groups(sec: _Sections, vals: _Values) -> tuple[list[OptimizerGroup], dict[str, int]]:
    """The param groups (as saved in the nested layout; rebuilt from equal hyper-parameters in the flattened one)
    and ``FQN -> group index``."""
    groups: list[OptimizerGroup] = []
    group_of: dict[str, int] = {}
    prefix, models = sec.groups_prefix, sec.models
    if sec.fmt is DcpOptimizerFormat.NESTED:
        for middle in sorted(sec.group_items, key=lambda m: (not m.isdigit(), int(m) if m.isdigit() else 0, m)):
            by_key = dict(sec.group_items[middle])
            if not middle.isdigit() or "params" not in by_key:
                vals.problems.append(f"'{prefix}{middle}' is not a saved param group (no index or no 'params')")
                continue
            params_item = by_key["params"]
            names = vals.value(params_item) if isinstance(params_item, _Bytes) else None
            if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
                vals.problems.append(f"'{prefix}{middle}.params' holds {type(names).__name__}, not a list of FQNs")
                continue
            hp = _hyperparams(sec.group_items[middle], f"{prefix}{middle}", vals)
            for n in names:
                if models and n not in models:
                    vals.problems.append(f"'{prefix}{middle}.params' names '{n}', which the model state lacks")
                elif n in group_of:
                    vals.problems.append(f"'{prefix}{middle}.params' names '{n}', which group {group_of[n]} "
                                         "holds too")
                else:
                    group_of[n] = len(groups)
            groups.append(OptimizerGroup(len(groups), tuple(names), None, tuple(hp)))
    elif sec.fmt is DcpOptimizerFormat.FLATTENED:
        split: dict[tuple[tuple[str, Any], ...], list[str]] = {}
        for fqn, kv in sec.group_items.items():
            if models and fqn not in models:
                vals.problems.append(f"'{prefix}{fqn}.{kv[0][0]}' names '{fqn}', which the model state lacks")
                continue
            split.setdefault(tuple(_hyperparams(kv, f"{prefix}{fqn}", vals)), []).append(fqn)
        for hp_key, names in split.items():
            for n in names:
                group_of[n] = len(groups)
            groups.append(OptimizerGroup(len(groups), tuple(names), None, hp_key))
    return groups, group_of


def _check_states(sec: _Sections, param_states: list[DcpParamState], group_of: dict[str, int],
                  problems: list[str]) -> None:
    """Every param with state is in a group (when groups are saved), and holds the per-element states the other
    params of its group hold, each of its param's shape."""
    if sec.fmt is not None:
        for ps in param_states:
            if ps.name not in group_of and ps.name in sec.models:
                problems.append(f"'{sec.state_prefix}{ps.name}': '{ps.name}' has optimizer state but is in no "
                                f"param group ('{sec.groups_prefix}*')")
    by_group: dict[int | None, list[DcpParamState]] = {}
    for ps in param_states:
        by_group.setdefault(group_of.get(ps.name), []).append(ps)
    for members in by_group.values():
        union = dict.fromkeys(k for ps in members for k in ps.state_keys)
        for ps in members:
            missing = [k for k in union if k not in ps.state_keys]
            misfit = dict(ps.other)
            if missing and missing[0] in misfit:
                _, dtype, shape = misfit[missing[0]]
                problems.append(f"'{sec.state_prefix}{ps.name}.{missing[0]}' is {dtype} {list(shape)}, not the "
                                f"shape of '{ps.name}' {list(sec.models[ps.name].shape)} as in the other params of "
                                "its group")
            elif missing:
                problems.append(f"'{sec.state_prefix}{ps.name}.{missing[0]}' is missing: '{ps.name}' has "
                                f"{', '.join(ps.state_keys) or 'no per-element state'} but not "
                                f"{', '.join(missing)}, which the other params of its group hold")


def _entries(sec: _Sections, attached: dict[str, list[tuple[str, _Item]]], group_of: dict[str, int],
             has_optim: bool, cache: DcpCache) -> list[TensorEntry]:
    """One entry per model tensor, its per-element optimizer states attached; a param with optimizer state is
    trained; without any optimizer state (a model-only folder) whether a param was trained is "undetermined"."""
    entries: list[TensorEntry] = []
    for name, it in sec.models.items():
        pieces = [Piece(Role.MODULE, it.dtype, tuple(_fragment(it, ch) for ch in it.chunks))]
        for key, st in attached.get(name, ()):
            pieces.append(Piece(Role.OPTIM_STATE, st.dtype, tuple(_fragment(st, ch) for ch in st.chunks),
                                state_key=key))
        buffer = name.endswith(_BUFFER_SUFFIXES)
        entries.append(TensorEntry(name, it.shape, Kind.BUFFER if buffer else Kind.PARAM,
                                   name in attached and not buffer, tuple(pieces), group=group_of.get(name),
                                   ambiguous=not has_optim and not buffer))
    if has_optim:
        _prove_ties(entries, attached, group_of, cache)
    return entries


def _prove_ties(entries: list[TensorEntry], attached: dict[str, list[tuple[str, _Item]]],
                group_of: dict[str, int], cache: DcpCache) -> None:
    """A tied param: torch's get_state_dict lists it under every name in the model state, and under its first name
    only in the optimizer state and groups. A param in no group and without state that equals, bit for bit, one
    with state is made its alias (in place). Two frozen params of equal values are left apart: nothing tells a
    tie from a coincidence (norm weights still all ones) there."""
    by_name = {e.name: e for e in entries}
    sources = [e for e in entries if e.name in attached]
    for i, e in enumerate(entries):
        if e.kind is not Kind.PARAM or e.name in attached or e.name in group_of:
            continue
        for src in sources:
            if src.shape == e.shape and src.stored_dtype == e.stored_dtype and _same_values(e, src, cache):
                entries[i] = alias_entry(e.name, by_name[src.name])
                break


def _notes(sec: _Sections, param_states: list[DcpParamState], attached: dict[str, Any], group_of: dict[str, int],
           model_only: bool) -> tuple[list[str], int | None]:
    """What the reader says of the optimizer side, and the one step every param holds (None when they differ, or
    it is not a whole number)."""
    notes: list[str] = []
    steps = {ps.step for ps in param_states if ps.step is not None}
    step_value: int | None = None
    if len(steps) == 1:
        only = next(iter(steps))
        step_value = int(only) if float(only).is_integer() else None
    elif len(steps) > 1:
        notes.append("the params' optimizer steps differ: " + ", ".join(
            f"{ps.name} {ps.step:g}" for ps in param_states if ps.step is not None))
    stateless = [n for n in group_of if n not in attached]
    if stateless:
        notes.append(f"{len(stateless)} param(s) of the optimizer's groups hold no optimizer state (frozen, or never "
                     f"given a gradient), counted frozen: {', '.join(stateless[:5])}"
                     + (f" (+{len(stateless) - 5} more)" if len(stateless) > 5 else ""))
    if sec.fmt is DcpOptimizerFormat.FLATTENED:
        notes.append(f"the optimizer state was saved flattened ({sec.groups_prefix}<fqn>.<key>): the param groups "
                     "are not saved, so params with equal hyper-parameters are taken as one group")
    if model_only:
        notes.append("model only: no optimizer state in this folder, so which params were trained and which are "
                     "tied is not recorded")
    return notes, step_value


def describe_dcp(path: str | os.PathLike[str]) -> DcpSource:
    """The DCP folder at ``path`` described (see the module docstring and :class:`DcpSource`). Reads ``.metadata``,
    the optimizer's non-tensor items (param groups, Python steps: each through the allow-listed unpickler within the
    read limits), each ``step`` tensor's value, and the values of a param without optimizer state that has the shape
    of one with state (to prove a tie). Raises :class:`CorruptCheckpointError` naming the keys of every
    inconsistency: an optimizer state or group naming an FQN the model state lacks, a param's state lacking a
    per-element state the other params of its group hold (or holding it in another shape), a param in two groups or
    in none, a ``step`` that is not a number; :class:`UnsupportedCheckpointError` for an optimizer state keyed by
    index."""
    folder = Path(path)
    cache = DcpCache()
    sec = _sections(folder, cache)
    to_parse = sum(isinstance(it, _Bytes) for kv in (*sec.states.values(), *sec.group_items.values()) for _, it in kv)
    if to_parse > limits.current().max_dcp_values:
        raise limits.exceeded(folder, f"an optimizer state of {to_parse} non-tensor items", None, "max_dcp_values")
    vals = _Values(cache)
    param_states, attached = _param_states(sec, vals)
    groups, group_of = _groups(sec, vals)
    problems = vals.problems
    _check_states(sec, param_states, group_of, problems)
    if problems:
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CorruptCheckpointError(f"{folder}: {'; '.join(problems[:3])}{more}; the optimizer state does not "
                                     "match the model state — the folder is corrupt or was assembled from "
                                     "different saves")
    has_optim = sec.optim_top is not None and (bool(param_states) or bool(groups))
    entries = _entries(sec, attached, group_of, has_optim, cache)
    dtypes = {e.stored_dtype for e in entries if e.kind is Kind.PARAM}
    precision = (Precision.FP16 if "float16" in dtypes else Precision.BF16 if "bfloat16" in dtypes
                 else Precision.FP32)
    notes, step_value = _notes(sec, param_states, attached, group_of, not has_optim)
    optimizer: DcpOptimizer | None = None
    if has_optim:
        assert sec.optim_top is not None
        group_keys = frozenset(k for g in groups for k, _ in g.hyperparams)
        state_keys = frozenset({k for ps in param_states for k in ps.state_keys}
                               | ({"step"} if any(ps.step is not None for ps in param_states) else set()))
        kind = optimizer_class_of(group_keys, state_keys, dict(groups[0].hyperparams)) if groups else None
        optimizer = DcpOptimizer(sec.optim_top, sec.fmt or DcpOptimizerFormat.NESTED, tuple(param_states),
                                 tuple(groups), sec.fmt is not DcpOptimizerFormat.FLATTENED, kind)
    kind_name = optimizer.optimizer_class if optimizer is not None else None
    logical = LogicalCheckpoint(
        root=folder, tag="", tag_dir=folder, layout="dcp", zero_stage=0, precision=precision, dp_world_size=1,
        pp_world_size=1, tp_world_size=1, ds_version=None, global_steps=_trainer_global_step(folder),
        global_samples=None, optimizer_step=step_value,
        optimizer_wrapper=("none (model only)" if optimizer is None
                           else f"torch.optim.{kind_name} (DCP)" if kind_name else "torch optimizer (DCP)"),
        entries=tuple(entries), files=sec.files, notes=tuple(notes), optimizer_groups=tuple(groups),
        optimizer_type=kind_name)
    return DcpSource(logical, cache, optimizer, sec.model_top)


def read_dcp(path: str | os.PathLike[str]) -> tuple[LogicalCheckpoint, DcpCache]:
    """The DCP folder at ``path`` as a logical checkpoint (see :func:`describe_dcp`)."""
    src = describe_dcp(path)
    return src.logical, src.cache
