"""A drop-in for DeepSpeed's ``deepspeed.utils.zero_to_fp32`` (0.19.8): same functions, signatures, defaults,
return values and output files, read through dsckpt.

Changing ``from deepspeed.utils.zero_to_fp32 import ...`` to ``from dsckpt.zero_to_fp32 import ...`` is the whole
migration, and ``python -m dsckpt.zero_to_fp32 CHECKPOINT_DIR OUTPUT_DIR [--safe_serialization]
[--max_shard_size 5GB] [-t TAG] [--exclude_frozen_parameters] [-d]`` takes the script's arguments.

Where DeepSpeed's functions work, these return the same keys (in the same order) and bit-identical tensors of the
same dtypes, and the converter writes the same file names, shards, index and tensors (``model.safetensors`` byte for
byte what safetensors' ``save_file`` writes for them); where DeepSpeed's raise (ZeRO stage 0,
``BF16_Optimizer``, pipeline, tensor-parallel and MoE layouts, universal folders, legacy non-zip files, tied
weights with ``safe_serialization``) these work. What differs on purpose:

* files are unpickled by dsckpt's allow-listing loader (:mod:`dsckpt.safe_load`), never by ``torch.load`` with
  code execution allowed (as DeepSpeed's does), and deepspeed is never imported;
* every tensor is read from its fragments only when needed (``lazy_mode=True`` reads nothing before
  ``.contiguous()``; the converter streams each tensor into its file in bounded chunks) and every torch zip
  record read is checked against its CRC-32 (:mod:`dsckpt.crc`);
* frozen parameters of a ZeRO stage-1 save are returned: DeepSpeed 0.19.8 drops them, as stage-1 saves have no
  ``frozen_param_fragments`` (``exclude_frozen_parameters=True`` gives its keys);
* with ``safe_serialization`` a tied alias (``head.weight`` of ``embed.weight``) is stored as a copy of its
  own, as safetensors cannot share storage (DeepSpeed's ``save_file`` raises there);
* errors are dsckpt's typed errors (:mod:`dsckpt.errors`) with one-line messages, not DeepSpeed's
  ``ValueError`` / ``FileNotFoundError`` / ``TypeError``; the command exits with dsckpt's codes (2 usage, 3 an
  unreadable, unsupported or unsafe checkpoint).

Importing this module imports neither torch nor deepspeed; the functions that return tensors import torch, the
converter and the command do not.
"""

from __future__ import annotations

import argparse
import functools
import json
import logging
import os
import shutil
import sys
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .errors import EXIT_BAD_CHECKPOINT, EXIT_INTERNAL, DsckptError, UsageError
from .model import Kind, TensorEntry

if TYPE_CHECKING:
    import torch

    from .checkpoint import Checkpoint
    from .model import LogicalCheckpoint
    from .writers.safetensors import TensorSpec

__all__ = [
    "LazyTensor",
    "OutputFile",
    "OutputPlan",
    "StateDictItem",
    "convert_zero_checkpoint_to_fp32_state_dict",
    "convert_zero_checkpoint_to_state_dict",
    "get_fp32_state_dict_from_zero_checkpoint",
    "load_state_dict_from_zero_checkpoint",
    "main",
    "plan_output",
    "plan_state_dict",
    "to_torch_tensor",
]

logger = logging.getLogger("dsckpt")

#: DeepSpeed's output names (``convert_zero_checkpoint_to_state_dict``): the weights file, and the index written
#: beside the shards, by ``safe_serialization``.
WEIGHTS_NAME = {False: "pytorch_model.bin", True: "model.safetensors"}
INDEX_NAME = {False: "pytorch_model.bin.index.json", True: "model.safetensors.index.json"}


# --------------------------------------------------------------------------------------------
# The plan: which keys, in which order, of which dtype


@dataclass(frozen=True)
class StateDictItem:
    """One key of the state dict DeepSpeed's ``get_fp32_state_dict_from_zero_checkpoint`` returns.

    ``dtype``: the dtype name of the returned tensor (trainable params: float32, from the fp32 master; frozen
    params: as stored, which is 16-bit in bf16/fp16 runs, as DeepSpeed returns them; buffers: float32 if
    floating, else as stored). ``alias_of``: an earlier key whose very tensor this key holds (a tied param)."""

    name: str
    entry: TensorEntry
    dtype: str
    alias_of: str | None = None


def _is_floating(dtype: str) -> bool:
    from .dtypes import dtype_info

    return dtype_info(dtype).is_floating


def _deepspeed_param_order(ckpt: LogicalCheckpoint, cache: Any) -> list[str] | None:
    """The trainable names in the order of rank 0's ``param_shapes`` (group by group), the order DeepSpeed's
    script returns them in; None where the layout has no such file (stage 0, pipeline, universal ...).

    The logical checkpoint keeps the module's order; ``param_shapes`` follows each optimizer group's own
    order, which differs under ``round_robin_gradients`` (DeepSpeed 0.19.8 stores the round-robin order)."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        path = ckpt.tag_dir / name
        if path not in ckpt.files:
            continue
        shapes = cache.tree(path).get("param_shapes")
        if isinstance(shapes, list) and all(isinstance(g, Mapping) for g in shapes):
            return [str(k) for g in shapes for k in g]
    return None


def plan_state_dict(ckpt: LogicalCheckpoint, *, exclude_frozen: bool = False,
                    param_order: Sequence[str] | None = None) -> tuple[StateDictItem, ...]:
    """The keys of DeepSpeed's consolidated state dict for ``ckpt``, in its order: buffers, frozen params
    (unless ``exclude_frozen``), trainable params (in ``param_order`` where it names exactly them, else group
    by group in module order), then tied aliases whose source is present. An alias whose source the save left
    out (:attr:`LogicalCheckpoint.excluded_ties`: a PEFT run's ``lm_head`` tied to its excluded embedding) is left
    out too, as DeepSpeed's function leaves it. Pure: reads no tensor data.

    Raises :class:`~dsckpt.binding.AmbiguousBindingError` where the answer depends on a binding the files
    leave open (which stage-0 params are trainable; see :meth:`LogicalCheckpoint.require_unambiguous`)."""
    # Which params are frozen decides both exclude_frozen and the dtype returned (DeepSpeed gives frozen
    # params in their stored 16-bit dtype, trainable ones in fp32).
    flags = exclude_frozen or any(e.ambiguous and e.source_for_fp32().dtype != "float32" for e in ckpt.entries)
    ckpt.require_unambiguous("zero_to_fp32" + (" with exclude_frozen_parameters" if exclude_frozen else ""),
                             values=True, flags=flags)
    left_out = {alias for alias, _ in ckpt.excluded_ties}
    own = [e for e in ckpt.entries if e.tied_to is None and e.name not in left_out]
    buffers = [e for e in own if e.kind is Kind.BUFFER]
    frozen = [e for e in own if e.kind is Kind.PARAM and not e.trainable]
    trainable = [e for e in own if e.kind is Kind.PARAM and e.trainable]
    if param_order is not None and sorted(param_order) == sorted(e.name for e in trainable):
        by_name = {e.name: e for e in trainable}
        trainable = [by_name[n] for n in param_order]
    else:
        trainable.sort(key=lambda e: -1 if e.group is None else e.group)  # stable: module order within a group
    items: list[StateDictItem] = []
    for e in buffers:
        stored = e.source_for_fp32().dtype
        items.append(StateDictItem(e.name, e, "float32" if _is_floating(stored) else stored))
    if not exclude_frozen:
        items += [StateDictItem(e.name, e, e.source_for_fp32().dtype) for e in frozen]
    for e in trainable:
        stored = e.source_for_fp32().dtype
        items.append(StateDictItem(e.name, e, "float32" if _is_floating(stored) else stored))
    present = {i.name for i in items}
    for e in ckpt.entries:
        if e.tied_to is not None and e.tied_to in present:
            source = next(i for i in items if i.name == e.tied_to)
            items.append(StateDictItem(e.name, e, source.dtype, alias_of=e.tied_to))
    return tuple(items)


def _open(checkpoint_dir: str | os.PathLike[str], tag: str | None) -> Checkpoint:
    from .checkpoint import open_checkpoint

    return open_checkpoint(checkpoint_dir, tag=tag)


def _items(ckpt: Checkpoint, exclude_frozen: bool) -> tuple[StateDictItem, ...]:
    logical = ckpt.logical
    return plan_state_dict(logical, exclude_frozen=exclude_frozen,
                           param_order=_deepspeed_param_order(logical, ckpt.cache))


# --------------------------------------------------------------------------------------------
# Reading


def _read(item: StateDictItem, ckpt: Checkpoint) -> torch.Tensor:
    import torch

    from .assemble import read_entry

    t = read_entry(item.entry, ckpt.cache)
    want = getattr(torch, item.dtype)
    return t.to(want) if t.dtype != want else t


class _LazyGroup:
    """What the values of one lazy state dict share: the open checkpoint, and which of them were read. Once
    every one was, the CRC-32 checks of every record read are completed (DeepSpeed's script has none)."""

    def __init__(self, ckpt: Checkpoint, n_values: int) -> None:
        self.ckpt = ckpt
        self.unread = n_values
        self.checked = False

    def read(self, tensor: LazyTensor) -> torch.Tensor:
        t = _read(tensor.item, self.ckpt)
        if not tensor._read_once:
            tensor._read_once = True
            self.unread -= 1
        if self.unread == 0 and not self.checked:
            self.ckpt.finish_checks()
            self.checked = True
        return t


class LazyTensor:
    """A value of ``get_fp32_state_dict_from_zero_checkpoint(..., lazy_mode=True)``: DeepSpeed's
    ``GatheredTensor``. Nothing is read until :meth:`contiguous` (or :meth:`to`), which assembles the tensor
    from its fragments and returns a new CPU tensor each call. ``shape`` (a ``torch.Size``) and ``dtype``
    (a ``torch.dtype``) are known without reading.

    Every torch zip record read for the state dict's values is checked against its CRC-32 once the last
    distinct value has been read (that read raises :class:`~dsckpt.errors.CorruptCheckpointError` if a record
    is damaged): a record's CRC covers all of it, so a check needs every byte of it."""

    __slots__ = ("_group", "_read_once", "item")

    def __init__(self, item: StateDictItem, group: _LazyGroup) -> None:
        self.item = item
        self._group = group
        self._read_once = False

    @property
    def shape(self) -> torch.Size:
        import torch

        return torch.Size(self.item.entry.shape)

    @property
    def dtype(self) -> torch.dtype:
        import torch

        dtype: torch.dtype = getattr(torch, self.item.dtype)
        return dtype

    def numel(self) -> int:
        return self.item.entry.numel

    def dim(self) -> int:
        return len(self.item.entry.shape)

    def size(self, dim: int | None = None) -> Any:
        return self.shape if dim is None else self.shape[dim]

    def is_floating_point(self) -> bool:
        return _is_floating(self.item.dtype)

    def contiguous(self) -> torch.Tensor:
        """The tensor, read now (a new CPU tensor)."""
        return self._group.read(self)

    def to(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        """``self.contiguous().to(*args, **kwargs)``."""
        return self.contiguous().to(*args, **kwargs)

    def __repr__(self) -> str:
        return f"LazyTensor({self.item.name!r}, shape={list(self.item.entry.shape)}, dtype={self.item.dtype})"


def _lazy_state_dict(ckpt: Checkpoint, items: tuple[StateDictItem, ...]) -> OrderedDict[str, LazyTensor]:
    group = _LazyGroup(ckpt, sum(1 for i in items if i.alias_of is None))
    out: OrderedDict[str, LazyTensor] = OrderedDict()
    for item in items:
        out[item.name] = out[item.alias_of] if item.alias_of is not None else LazyTensor(item, group)
    if group.unread == 0:
        ckpt.finish_checks()
    return out


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir: str | os.PathLike[str], tag: str | None = None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict[str, Any]:
    """Consolidate a DeepSpeed checkpoint into one fp32 state dict (DeepSpeed 0.19.8's function of this name).

    Args:
        checkpoint_dir: the save dir (the one holding ``latest`` and the tag folders) or a tag folder.
        tag: the tag folder to read, e.g. ``global_step14``; by default the one ``latest`` names.
        exclude_frozen_parameters: leave out params that were not trained (``requires_grad=False``).
        lazy_mode: return :class:`LazyTensor` values, read one at a time by ``.contiguous()``.

    Returns:
        ``{name: tensor}`` on the CPU: buffers, frozen params, trainable params, tied aliases (the same tensor
        object as their source), in DeepSpeed's order. Trainable params come from the fp32 master weights,
        frozen ones in their stored dtype (16-bit in bf16/fp16 runs), floating buffers as float32. Eager: a
        ``dict`` of tensors, every record read checked against its CRC-32 before it returns; lazy: an
        ``OrderedDict`` of :class:`LazyTensor`.

    Raises:
        dsckpt.errors.DsckptError: a subclass saying what is wrong (see :mod:`dsckpt.errors`), where DeepSpeed's
            raises ``ValueError`` / ``FileNotFoundError``."""
    ckpt = _open(checkpoint_dir, tag)
    items = _items(ckpt, exclude_frozen_parameters)
    if lazy_mode:
        return _lazy_state_dict(ckpt, items)
    out: dict[str, Any] = {}
    for item in items:
        out[item.name] = out[item.alias_of] if item.alias_of is not None else _read(item, ckpt)
    ckpt.finish_checks()
    return out


def to_torch_tensor(state_dict: Mapping[str, Any], return_empty_tensor: bool = False,
                    dtype: Any = None) -> dict[str, torch.Tensor]:
    """DeepSpeed's ``to_torch_tensor``: a lazy state dict's values as tensors (shared values stay shared);
    floating ones cast to ``dtype`` if given; ``return_empty_tensor``: uninitialised tensors of the right shape
    and dtype, nothing read."""
    import torch

    from .convert import parse_dtype

    want = getattr(torch, parse_dtype(dtype)) if dtype is not None else None
    out: dict[str, torch.Tensor] = {}
    first_name: dict[int, str] = {}
    for name, value in state_dict.items():
        if id(value) in first_name:
            out[name] = out[first_name[id(value)]]
            continue
        first_name[id(value)] = name
        target = want if value.is_floating_point() else None
        if return_empty_tensor:
            out[name] = torch.empty(tuple(value.shape), dtype=target or value.dtype)
        else:
            t = value.contiguous()
            out[name] = t.to(dtype=target) if target is not None else t
    return out


def load_state_dict_from_zero_checkpoint(model: Any, checkpoint_dir: str | os.PathLike[str],
                                         tag: str | None = None) -> Any:
    """DeepSpeed's function of this name: move ``model`` to the CPU, load the consolidated fp32 state dict
    into it with ``load_state_dict(..., strict=False)`` and return it. The model is no longer usable by the
    DeepSpeed engine that wrapped it."""
    logger.info("Extracting fp32 weights")
    state_dict = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    logger.info("Overwriting model with fp32 weights")
    model = model.cpu()
    model.load_state_dict(state_dict, strict=False)
    return model


# --------------------------------------------------------------------------------------------
# The converter


@dataclass(frozen=True)
class OutputFile:
    filename: str
    names: tuple[str, ...]  # in file order; a tied alias follows in the file of its source


@dataclass(frozen=True)
class OutputPlan:
    """What ``convert_zero_checkpoint_to_state_dict`` writes into ``output_dir``: the files, and the index
    (``index_text``, byte for byte as DeepSpeed writes it) when there is more than one."""

    output_dir: Path
    safe_serialization: bool
    dtype: str
    items: tuple[StateDictItem, ...]
    files: tuple[OutputFile, ...]
    index_filename: str | None
    index_text: str | None

    def spec(self, item: StateDictItem) -> TensorSpec:
        return _output_spec(item, self.dtype)


def _output_spec(item: StateDictItem, dtype: str) -> TensorSpec:
    """How ``item`` is written: floating tensors in ``dtype``, others as they are."""
    from .writers.safetensors import TensorSpec

    return TensorSpec(item.name, dtype if _is_floating(item.dtype) else item.dtype, item.entry.shape)


def _parse_shard_size(max_shard_size: str | int) -> int:
    """huggingface_hub's ``parse_size_to_int`` ("5GB" = 5 * 10**9; KB/MB/GB/TB; an int is bytes), and what
    dsckpt's ``--max-shard-size`` also reads (``2GiB``, ``500B``)."""
    from .convert import parse_size

    if isinstance(max_shard_size, bool) or not isinstance(max_shard_size, (str, int)):
        raise UsageError(f"max_shard_size must be a size such as '5GB' or a number of bytes, not {max_shard_size!r}")
    return parse_size(max_shard_size)


def plan_output(items: Sequence[StateDictItem], output_dir: str | os.PathLike[str], *, dtype: str = "float32",
                max_shard_size: str | int | None = "5GB", safe_serialization: bool = False) -> OutputPlan:
    """The files DeepSpeed 0.19.8's converter writes for ``items``: huggingface_hub's
    ``split_torch_state_dict_into_shards`` (keys in order fill a shard until the next would overflow
    ``max_shard_size``; a larger tensor gets a shard of its own; a tied alias, and every empty tensor after the
    first (they share storage id 0 there), goes with the first key of its storage and adds no size), named
    ``pytorch_model{-0000i-of-0000N}.bin`` or ``model{...}.safetensors``. ``max_shard_size=None``: one file.
    Pure."""
    from .convert import parse_dtype

    dtype = parse_dtype(dtype)
    weights = WEIGHTS_NAME[bool(safe_serialization)]
    if max_shard_size is None:
        return OutputPlan(Path(output_dir), bool(safe_serialization), dtype, tuple(items),
                          (OutputFile(weights, tuple(i.name for i in items)),), None, None)
    limit = _parse_shard_size(max_shard_size)
    storage_of: dict[str, str] = {}  # key -> first key of its storage
    first_empty: str | None = None
    shards: list[list[str]] = []
    current: list[str] = []
    current_nbytes = total = 0
    for item in items:
        spec = _output_spec(item, dtype)
        source = storage_of.get(item.alias_of) if item.alias_of is not None else None
        if source is None and spec.nbytes == 0:
            source = first_empty
            first_empty = first_empty or item.name
        if source is not None:
            storage_of[item.name] = source
            continue
        storage_of[item.name] = item.name
        if spec.nbytes > limit:
            total += spec.nbytes
            shards.append([item.name])
            continue
        if current_nbytes + spec.nbytes > limit:
            shards.append(current)
            current, current_nbytes = [], 0
        current.append(item.name)
        current_nbytes += spec.nbytes
        total += spec.nbytes
    if current:
        shards.append(current)
    # then, storage by storage (in the order of their first keys), the other keys go where the first one went
    source_to_aliases: dict[str, list[str]] = {}
    for name, source in storage_of.items():
        source_to_aliases.setdefault(source, [])
        if source != name:
            source_to_aliases[source].append(name)
    for source, aliases in source_to_aliases.items():
        if aliases:
            next(s for s in shards if source in s).extend(aliases)
    n = len(shards)
    if n <= 1:
        return OutputPlan(Path(output_dir), bool(safe_serialization), dtype, tuple(items),
                          (OutputFile(weights, tuple(shards[0]) if shards else ()),), None, None)
    stem, ext = weights.rsplit(".", 1)
    files = tuple(OutputFile(f"{stem}-{i + 1:05d}-of-{n:05d}.{ext}", tuple(s)) for i, s in enumerate(shards))
    weight_map = {name: f.filename for f in files for name in f.names}
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    return OutputPlan(Path(output_dir), bool(safe_serialization), dtype, tuple(items), files,
                      INDEX_NAME[bool(safe_serialization)], json.dumps(index, indent=2, sort_keys=True) + "\n")


#: safetensors' ``save_file`` lays tensors out by dtype in this order, then by name (its Rust ``Dtype`` enum,
#: descending; safetensors 0.8.0): writing them in the same order gives the bytes DeepSpeed's ``save_file`` call
#: would write.
SAFETENSORS_DTYPE_ORDER = ("I64", "F64", "F32", "I32", "BF16", "F16", "I16", "I8", "U8", "BOOL")


def _write_safetensors(path: Path, plan: OutputPlan, file: OutputFile, ckpt: Checkpoint) -> None:
    from .convert import ConvertPlan, OutputFormat, run_to_fp32

    by_name = {i.name: i for i in plan.items}
    specs = tuple(sorted((plan.spec(by_name[n]) for n in file.names),
                         key=lambda s: (SAFETENSORS_DTYPE_ORDER.index(s.code), s.name)))
    # to-fp32's streaming writer (bounded chunks, CRC-32 checks completed before the rename, the file reopened and
    # checked), with DeepSpeed's metadata
    convert_plan = ConvertPlan(output=path, format=OutputFormat.SAFETENSORS, specs=specs,
                               name_to_entry={n: by_name[n].entry for n in file.names}, shards=None,
                               metadata={"format": "pt"})
    run_to_fp32(convert_plan, ckpt.cache)


def _chunks(item: StateDictItem, spec: TensorSpec, ckpt: Checkpoint) -> Iterator[Any]:
    """``item``'s bytes as ``spec`` wants them, front to back, in bounded chunks read straight from its fragments
    (numpy; views into one reused buffer, each valid until the next is asked for), as ``to-fp32`` streams them;
    a tensor whose fragments cannot be streamed so comes whole, through torch."""
    import numpy as np

    from .chunks import plan_piece_chunks, read_chunks
    from .convert import convert_chunk

    reads = plan_piece_chunks(item.entry.source_for_fp32(), spec.shape, ckpt.cache, name=spec.name)
    if reads is None:
        import torch

        t = _read(item, ckpt)
        want = getattr(torch, spec.dtype)
        yield (t.to(want) if t.dtype != want else t).contiguous().reshape(-1).view(torch.uint8).numpy()
        return
    stream = read_chunks(reads, workers=0)
    try:
        for expected in reads:
            got, raw = next(stream)
            assert got is expected, f"streamed {got.name} while writing {spec.name}"
            chunk, _ = convert_chunk(raw, got.ref.dtype_name, spec.dtype)
            yield np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    finally:
        stream.close()


def _write_torch(path: Path, plan: OutputPlan, file: OutputFile, ckpt: Checkpoint) -> None:
    """``torch.save``'s format, one storage at a time (:func:`dsckpt.writers.torch_stream.write_torch_tree`; torch
    is not imported): a tied alias is the same object as its source in the pickle, so ``torch.load`` gives one
    tensor for both, as after DeepSpeed's ``torch.save``."""
    from .writers.torch_stream import ChunkedTensor, verify_torch_file, write_torch_tree

    by_name = {i.name: i for i in plan.items}
    tree: dict[str, Any] = {}
    specs = []
    for name in file.names:
        item = by_name[name]
        spec = plan.spec(item)
        specs.append(spec)
        if item.alias_of is not None and item.alias_of in tree:
            tree[name] = tree[item.alias_of]
            continue
        tree[name] = ChunkedTensor(spec.dtype, spec.shape, functools.partial(_chunks, item, spec, ckpt))

    def check(tmp: Path) -> None:
        ckpt.finish_checks()
        verify_torch_file(tmp, specs, target=path)

    write_torch_tree(path, tree, check=check)


def run_output(plan: OutputPlan, ckpt: Checkpoint) -> list[Path]:
    """Write ``plan``'s files into its folder (created if missing; other files there are left alone, files of the
    same names replaced with a warning, as DeepSpeed's converter replaces them). Each is written and re-opened in a
    temporary folder beside them, every input record read is checked against its CRC-32, and only then are they moved
    into place, the index last: a failure leaves ``output_dir`` as it was."""
    from .atomic import fsync_dir, scratch_dir

    out = plan.output_dir
    if out.exists() and not out.is_dir():
        raise UsageError(f"output_dir '{out}' exists and is not a folder; name a folder for the state dict files")
    created = not out.exists()
    written: list[Path] = []
    try:
        with scratch_dir(out / plan.files[0].filename) as tmp:
            for file in plan.files:
                write = _write_safetensors if plan.safe_serialization else _write_torch
                write(tmp / file.filename, plan, file, ckpt)
            if plan.index_filename is not None and plan.index_text is not None:
                (tmp / plan.index_filename).write_text(plan.index_text, encoding="utf-8")
            ckpt.finish_checks()
            names = [f.filename for f in plan.files] + ([plan.index_filename] if plan.index_filename else [])
            for name in names:
                if (out / name).exists():  # as DeepSpeed's converter does (e.g. a Trainer's model.safetensors)
                    logger.warning("replaced the existing '%s'", out / name)
                os.replace(tmp / name, out / name)
                written.append(out / name)
            fsync_dir(out)
    except BaseException:
        if created and not written:
            shutil.rmtree(out, ignore_errors=True)  # made by this call, holding nothing of the user's
        raise
    return written


def convert_zero_checkpoint_to_state_dict(checkpoint_dir: str | os.PathLike[str], output_dir: str | os.PathLike[str],
                                          dtype: Any = "float32", max_shard_size: str | int | None = "5GB",
                                          safe_serialization: bool = False, tag: str | None = None,
                                          exclude_frozen_parameters: bool = False) -> None:
    """DeepSpeed 0.19.8's ``convert_zero_checkpoint_to_state_dict``: write the consolidated state dict into
    ``output_dir`` as ``pytorch_model.bin`` (``torch.load``-able) or, with ``safe_serialization``,
    ``model.safetensors``; above ``max_shard_size`` as shards plus an index json (see :func:`plan_output`).
    Floating tensors are written as ``dtype`` (float32, float16 or bfloat16, a name or a ``torch.dtype``;
    DeepSpeed's default is ``torch.float32``), others keep theirs. Returns None, as DeepSpeed's does."""
    from .convert import parse_dtype

    dtype = parse_dtype(dtype)
    ckpt = _open(checkpoint_dir, tag)
    plan = plan_output(_items(ckpt, exclude_frozen_parameters), output_dir, dtype=dtype,
                       max_shard_size=max_shard_size, safe_serialization=safe_serialization)
    run_output(plan, ckpt)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir: str | os.PathLike[str],
                                               output_dir: str | os.PathLike[str],
                                               max_shard_size: str | int | None = "5GB",
                                               safe_serialization: bool = False, tag: str | None = None,
                                               exclude_frozen_parameters: bool = False) -> None:
    """DeepSpeed's ``convert_zero_checkpoint_to_fp32_state_dict``: :func:`convert_zero_checkpoint_to_state_dict`
    in float32."""
    convert_zero_checkpoint_to_state_dict(checkpoint_dir, output_dir, dtype="float32", max_shard_size=max_shard_size,
                                          safe_serialization=safe_serialization, tag=tag,
                                          exclude_frozen_parameters=exclude_frozen_parameters)


# --------------------------------------------------------------------------------------------
# python -m dsckpt.zero_to_fp32


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m dsckpt.zero_to_fp32",
        description="Consolidate a DeepSpeed checkpoint into an fp32 state dict: DeepSpeed's zero_to_fp32.py, "
                    "read safely by dsckpt. Exit codes: 0 ok, 2 usage error, 3 unreadable, unsupported, "
                    "corrupt or unsafe checkpoint.")
    parser.add_argument("checkpoint_dir", type=str,
                        help="path to the desired checkpoint folder, e.g., path/checkpoint-12")
    parser.add_argument("output_dir", type=str,
                        help="directory to the pytorch fp32 state_dict output files (e.g. path/checkpoint-12-output/)")
    parser.add_argument("--max_shard_size", type=str, default="5GB",
                        help="the maximum size of a file before the state dict is sharded, e.g. 5GB (the default)")
    parser.add_argument("--safe_serialization", default=False, action="store_true",
                        help="write model.safetensors rather than pytorch_model.bin (pickle)")
    parser.add_argument("-t", "--tag", type=str, default=None,
                        help="checkpoint tag used as a unique identifier for checkpoint, e.g., global_step1")
    parser.add_argument("--exclude_frozen_parameters", action="store_true", help="exclude frozen parameters")
    parser.add_argument("-d", "--debug", action="store_true", help="enable debug")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The command: DeepSpeed's ``zero_to_fp32.py`` arguments; one summary line on stdout, errors as one line
    on stderr. Returns the exit code."""
    args = _parser().parse_args(argv)
    log = logging.getLogger("dsckpt")
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("zero_to_fp32: %(levelname)s: %(message)s"))
    log.addHandler(handler)
    level = log.level
    if args.debug:
        log.setLevel(logging.DEBUG)
    try:
        ckpt = _open(args.checkpoint_dir, args.tag)
        items = _items(ckpt, args.exclude_frozen_parameters)
        plan = plan_output(items, args.output_dir, max_shard_size=args.max_shard_size,
                           safe_serialization=args.safe_serialization)
        files = run_output(plan, ckpt)
    except DsckptError as e:
        return _fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        return _fail("interrupted; nothing was moved into the output folder", 130)
    except OSError as e:
        where = f"'{e.filename}': " if e.filename else ""
        return _fail(f"{where}{e.strerror or e}", EXIT_BAD_CHECKPOINT)
    except Exception as e:
        if os.environ.get("DSCKPT_DEBUG"):
            raise
        return _fail(f"internal error ({type(e).__name__}: {e}). This is a dsckpt bug: please report it with the "
                     "command you ran; rerun with DSCKPT_DEBUG=1 for a traceback", EXIT_INTERNAL)
    finally:
        log.removeHandler(handler)
        log.setLevel(level)
    n_params = sum(1 for i in items if i.entry.kind is Kind.PARAM)
    shown = ", ".join(p.name for p in files)
    print(f"wrote {shown} to {args.output_dir}: {n_params} params and {len(items) - n_params} buffers in "
          f"{plan.dtype} from {ckpt.logical.tag_dir}")
    return 0


def _fail(message: str, code: int) -> int:
    print(f"zero_to_fp32: error: {' '.join(message.splitlines())}", file=sys.stderr)
    return code


if __name__ == "__main__":
    sys.exit(main())
