"""``to-dcp``: the whole training state as a PyTorch distributed checkpoint (DCP) folder.

OUT holds the state dict ``{"model": M, "optim": O}`` that FSDP2 (``fully_shard``), torchtitan-style loops and a
plain process resume from::

    msd, osd = get_model_state_dict(model), get_optimizer_state_dict(model, optimizer)
    dcp.load({"model": msd, "optim": osd}, checkpoint_id=OUT)
    set_state_dict(model, optimizer, model_state_dict=msd, optim_state_dict=osd)

* M is what ``torch.distributed.checkpoint.state_dict.get_model_state_dict`` lists: FQN keys in state-dict order;
  the fp32 masters of trained params (``dtype`` to change that), frozen params and buffers as saved; a tied param
  under every name ``model.state_dict()`` lists, each with the source's values.
* O is what ``get_optimizer_state_dict`` gives: ``state`` keyed by FQN, trained params only, a tied param once under
  its first name, every optimizer state tensor as stored (fp32) plus ``step`` as a 0-dim float32 tensor (what torch's
  Adam/AdamW keep); ``param_groups`` one per DeepSpeed group in DeepSpeed's order (DCP loads them by position),
  each with ``params`` (the FQNs, in the optimizer's order) and every key the optimizer's own groups have: the values
  DeepSpeed saved, and torch's defaults for keys this torch's optimizer has and the save lacks (a strict load
  fails on a missing key). A DeepSpeed "Adam" run with ``torch_adam`` is torch's AdamW (``decoupled_weight_decay``
  True) and stays so.

:func:`plan_to_dcp` decides every key, dtype and shape without reading tensor data; :func:`run_to_dcp` writes with
DCP's own ``dcp.save``, planner and :class:`~torch.distributed.checkpoint.FileSystemWriter` (``.metadata`` is DCP's),
whose ``write_data`` alone is dsckpt's (:class:`_DataFiles`): the files DCP writes with ``single_file_per_rank``,
``__0_0.distcp`` ... one per ``workers`` thread, each tensor in ``torch.save``'s format at its offset, its bytes
copied from the checkpoint's files through a few 512 KiB buffers (CRC-checked as they are read), so memory stays flat
whatever the model size, as in ``to-fp32``. The copying starts before DCP is imported and plans, which it overlaps.
The folder appears atomically (:func:`dsckpt.atomic.atomic_dir`) and durably, with one fsync per file (by the
thread that wrote it) and per folder. ``--distributed``: every rank plans the same state dict and
DCP's own planner spreads the tensors over the ranks by bytes (its de-duplication of replicated items); rank 0
writes ``.metadata`` and moves the folder into place.
"""

from __future__ import annotations

import io
import logging
import os
import sys
import threading
import warnings
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .atomic import atomic_dir, claim_output, refuse_overlap
from .convert import parse_dtype
from .dtypes import dtype_info
from .errors import CorruptCheckpointError, UnsupportedCheckpointError
from .model import Kind, LogicalCheckpoint, Piece, Role
from .readers import FileCache

if TYPE_CHECKING:
    import torch

    from .writers.torch_stream import StreamedTensor

__all__ = [
    "DcpGroup",
    "DcpPlan",
    "DcpResult",
    "DcpTensor",
    "describe_dcp_plan",
    "plan_to_dcp",
    "run_to_dcp",
    "run_to_dcp_distributed",
    "save_dcp_into",
    "split_dcp_plan",
]

logger = logging.getLogger("dsckpt")

MODEL_KEY = "model"
OPTIM_KEY = "optim"


@dataclass(frozen=True)
class DcpTensor:
    """One tensor of OUT: its path in the nested state dict (``("model", fqn)`` or
    ``("optim", "state", fqn, state_key)``), dtype and shape, and where its values come from: ``piece`` of the
    logical tensor ``name`` (cast to ``dtype``), or, for ``step``, the number ``value``."""

    path: tuple[str, ...]
    dtype: str
    shape: tuple[int, ...]
    name: str
    piece: Piece | None = None
    value: float | None = None

    @property
    def fqn(self) -> str:
        """The key DCP stores it under (its flattened path)."""
        return ".".join(self.path)

    @property
    def nbytes(self) -> int:
        n = dtype_info(self.dtype).itemsize
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class DcpGroup:
    """One optimizer param group of O: DeepSpeed's ``index``, the FQNs of its params and every hyper-parameter
    (name, value) in the optimizer's key order, ``params`` excluded."""

    index: int
    params: tuple[str, ...]
    hyperparams: tuple[tuple[str, Any], ...]

    def as_dict(self) -> dict[str, Any]:
        return {**dict(self.hyperparams), "params": list(self.params)}


@dataclass(frozen=True)
class DcpPlan:
    output: Path
    tensors: tuple[DcpTensor, ...]
    groups: tuple[DcpGroup, ...]
    optimizer_class: str  # the torch.optim class O is for, e.g. "AdamW"
    dtype: str  # of the trained params' masters in M
    defaults_added: tuple[str, ...] = ()  # group keys the save lacks, filled with torch's defaults
    # the top-level keys of M and O; None: that part is not in this folder (a Trainer / Accelerate FSDP2 save keeps
    # {"model": M} and {"optimizer": O} in two folders, see dsckpt.run_folder_dcp)
    model_key: str | None = MODEL_KEY
    optim_key: str | None = OPTIM_KEY

    @property
    def total_nbytes(self) -> int:
        return sum(t.nbytes for t in self.tensors)

    @property
    def output_nbytes_bound(self) -> int:
        """At most this many bytes are written: tensor data plus each tensor's torch.save framing and metadata."""
        return self.total_nbytes + 65536 + sum(2048 + 4 * len(t.fqn) for t in self.tensors)

    @property
    def model_tensors(self) -> tuple[DcpTensor, ...]:
        return tuple(t for t in self.tensors if t.path[0] == self.model_key)

    @property
    def state_tensors(self) -> tuple[DcpTensor, ...]:
        return tuple(t for t in self.tensors if t.path[0] == self.optim_key)

    def state_dict(self) -> dict[str, Any]:
        """The nested state dict DCP plans from: shape-only (``meta``) tensors, the groups as plain values."""
        import torch

        root: dict[str, Any] = {}
        if self.model_key is not None:
            root[self.model_key] = {}
        if self.optim_key is not None:
            root[self.optim_key] = {"state": {}, "param_groups": []}
        for t in self.tensors:
            node = root
            for k in t.path[:-1]:
                node = node.setdefault(k, {})
            node[t.path[-1]] = torch.empty(t.shape, dtype=getattr(torch, t.dtype), device="meta")
        if self.optim_key is not None:
            root[self.optim_key]["param_groups"] = [g.as_dict() for g in self.groups]
        return root


@dataclass(frozen=True)
class DcpResult:
    plan: DcpPlan
    files: tuple[Path, ...]


# --------------------------------------------------------------------------------------------
# plan


#: DeepSpeed optimizer ``type`` (lower case) -> the torch.optim class that ran (DeepSpeed 0.19 engine.py
#: _configure_basic_optimizer: "Adam" with torch_adam is torch.optim.AdamW unless adam_w_mode is false).
_DS_TYPE_TO_TORCH = {"adam": "AdamW", "adamw": "AdamW", "sgd": "SGD", "adagrad": "Adagrad"}


def _optimizer_class(ckpt: LogicalCheckpoint, saved: dict[str, Any]) -> str | None:
    """The torch.optim class whose groups O must match, or None when the run's optimizer has no torch twin."""
    import torch

    cfg = (ckpt.ds_config or {}).get("optimizer") or {}
    kind = str(ckpt.optimizer_type or cfg.get("type") or "").strip()
    params = cfg.get("params") or {}
    if hasattr(torch.optim, kind) and kind not in ("Adam", "AdamW"):
        return kind
    name = _DS_TYPE_TO_TORCH.get(kind.lower())
    if name == "AdamW" or kind in ("Adam", "AdamW") or "decoupled_weight_decay" in saved:
        # the saved groups say which of the two ran; else the config (adam_w_mode defaults to true)
        if "decoupled_weight_decay" in saved:
            return "AdamW" if saved["decoupled_weight_decay"] else "Adam"
        if kind.lower() == "adam" and params.get("adam_w_mode", True) is False:
            return "Adam"
        return "AdamW"
    return name


def _class_defaults(name: str) -> dict[str, Any]:
    """The hyper-parameters a group of this torch's ``torch.optim.<name>`` holds, with their defaults: the keyword
    arguments of its ``__init__`` (and its Optimizer bases'), as the class puts them into ``defaults``. Read from the
    signatures rather than by building one: the first optimizer built imports torch._dynamo (seconds)."""
    import inspect

    import torch

    cls = getattr(torch.optim, name)
    out: dict[str, Any] = {}
    for klass in reversed(cls.__mro__):
        if not (isinstance(klass, type) and issubclass(klass, torch.optim.Optimizer)) \
                or klass is torch.optim.Optimizer or "__init__" not in vars(klass):
            continue
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.name not in ("self", "params") and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) \
                    and p.default is not p.empty:
                out[p.name] = p.default
    if name == "AdamW" and issubclass(cls, torch.optim.Adam):
        out["decoupled_weight_decay"] = True  # torch >= 2.6: AdamW is Adam(decoupled_weight_decay=True)
    return out


def plan_to_dcp(ckpt: LogicalCheckpoint, output: str | os.PathLike[str], *,
                dtype: str | torch.dtype = "float32") -> DcpPlan:
    """Decide every tensor and group of OUT (see the module docstring). Reads no tensor data, writes nothing.

    Refuses (:class:`~dsckpt.errors.UnsupportedCheckpointError`) a checkpoint whose reader does not describe the
    optimizer's param groups, a trained param without optimizer state, and optimizers with no torch class."""
    out = Path(output)
    refuse_overlap(out, ckpt.root, "write outside the checkpoint folder (and not onto the run folder holding it)")
    dtype = parse_dtype(dtype)
    ckpt.require_unambiguous("to-dcp", values=True, flags=True, moments=True)
    if ckpt.autoep is not None:
        # the FQNs of the HF model AutoEP wrapped (gate_up_proj, down_proj, gate), as to-fp32 writes them
        from .autoep import hf_model_view

        ckpt = hf_model_view(ckpt)
    by_name = {e.name: e for e in ckpt.entries}
    tensors: list[DcpTensor] = []
    for e in ckpt.entries:
        src = by_name.get(e.tied_to, e) if e.tied_to is not None else e
        piece = src.source_for_fp32()
        trained = e.kind is Kind.PARAM and src.trainable and src.piece(Role.MASTER) is not None
        floating = dtype_info(piece.dtype).is_floating
        want = dtype if trained and floating else piece.dtype
        tensors.append(DcpTensor((MODEL_KEY, e.name), want, e.shape, src.name, piece))

    groups_in = ckpt.optimizer_groups
    if not groups_in and ckpt.pipeline is not None and ckpt.pipeline.stage_optimizer_groups:
        from .readers.common import merge_stage_groups

        _, why = merge_stage_groups(ckpt.pipeline.stage_optimizer_groups)
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}': the pipeline stages' optimizers cannot be one optimizer's param groups: {why}; "
            "to-dcp merges group g of every stage into group g; 'dsckpt to-fp32' exports the weights")
    if not groups_in:
        from .ds_writers.facts import is_elastic

        if is_elastic(ckpt):
            raise UnsupportedCheckpointError(
                f"'{ckpt.tag_dir}': a zero_optimization.elastic_checkpoint save keeps no optimizer param groups (lr, "
                "betas, eps, weight_decay), which get_optimizer_state_dict() holds, so dsckpt would have to invent "
                "them; 'dsckpt to-fp32' exports the weights, 'dsckpt reshard' rewrites it as elastic ZeRO-1/2 files "
                "at another size")
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}': dsckpt does not read the optimizer's param groups of this layout ({ckpt.layout}), so "
            "it cannot write the optimizer state as get_optimizer_state_dict() does; 'dsckpt to-fp32' exports the "
            "weights")
    alias_to_source = {e.name: e.tied_to for e in ckpt.entries if e.tied_to is not None and e.tied_to in by_name}
    groups: list[DcpGroup] = []
    in_groups: set[str] = set()
    missing_state: list[str] = []
    saved0 = dict(groups_in[0].hyperparams)
    cls = _optimizer_class(ckpt, saved0)
    defaults = _class_defaults(cls) if cls is not None else {}
    added: set[str] = set()
    for g in groups_in:
        fqns = tuple(dict.fromkeys(alias_to_source.get(n, n) for n in g.param_names))
        saved = dict(g.hyperparams)
        hyper = {**{k: v for k, v in saved.items() if k != "params"},
                 **{k: v for k, v in defaults.items() if k not in saved}}  # the saved order, then what it lacks
        added.update(k for k in defaults if k not in saved)
        groups.append(DcpGroup(g.index, fqns, tuple(hyper.items())))
        step = g.step if g.step is not None else ckpt.optimizer_step
        for fqn in fqns:
            if fqn in in_groups:
                continue
            in_groups.add(fqn)
            entry = by_name.get(fqn)
            items = [(k, p) for k in entry.state_keys if (p := entry.state_piece(k)) is not None] \
                if entry is not None else []
            if entry is None or not items:
                missing_state.append(fqn)
                continue
            if step is None:
                raise UnsupportedCheckpointError(f"'{ckpt.tag_dir}': the optimizer's step count is not saved; "
                                                 "to-dcp needs it for the optimizer state")
            tensors.append(DcpTensor((OPTIM_KEY, "state", fqn, "step"), "float32", (), fqn, None, float(step)))
            for key, piece in items:
                tensors.append(DcpTensor((OPTIM_KEY, "state", fqn, key), piece.dtype, entry.shape, fqn, piece))
    if missing_state:
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}': no optimizer state for {', '.join(missing_state[:5])}"
            + (f" (+{len(missing_state) - 5} more)" if len(missing_state) > 5 else "")
            + "; get_optimizer_state_dict() has state for every trained param, so nothing was written")
    if cls is None:
        raise UnsupportedCheckpointError(
            f"'{ckpt.tag_dir}': the optimizer ({ckpt.optimizer_type or 'unknown'}) has no "
            "torch.optim class to resume into; to-dcp writes torch optimizers' state")
    return DcpPlan(out, tuple(tensors), tuple(groups), cls, dtype, tuple(sorted(added)))


def describe_dcp_plan(plan: DcpPlan) -> dict[str, Any]:
    """What every rank must agree on (``Group.agree``), and what ``--dry-run`` shows."""
    return {"output": str(plan.output), "optimizer": plan.optimizer_class, "dtype": plan.dtype,
            "tensors": [[t.fqn, t.dtype, list(t.shape)] for t in plan.tensors],
            "param_groups": [[g.index, list(g.params), [[k, repr(v)] for k, v in g.hyperparams]] for g in plan.groups],
            "defaults_added": list(plan.defaults_added)}


def split_dcp_plan(plan: DcpPlan, model_output: Path, optim_output: Path, *, model_key: str, optim_key: str,
                   groups: tuple[DcpGroup, ...] | None = None) -> tuple[DcpPlan, DcpPlan]:
    """``plan`` as two DCP folders, ``{model_key: M}`` at ``model_output`` and ``{optim_key: O}`` at
    ``optim_output`` (what Accelerate's ``save_fsdp_model`` / ``save_fsdp_optimizer`` write); ``groups`` replaces
    O's param groups (same params, regrouped). Pure."""
    assert plan.model_key is not None and plan.optim_key is not None, "split a plan of both parts"

    def reroot(t: DcpTensor, key: str) -> DcpTensor:
        return replace(t, path=(key, *t.path[1:]))

    model = replace(plan, output=Path(model_output), tensors=tuple(reroot(t, model_key) for t in plan.model_tensors),
                    groups=(), model_key=model_key, optim_key=None)
    optim = replace(plan, output=Path(optim_output), tensors=tuple(reroot(t, optim_key) for t in plan.state_tensors),
                    groups=plan.groups if groups is None else groups, model_key=None, optim_key=optim_key)
    return model, optim


# --------------------------------------------------------------------------------------------
# do


def _producer(cache: FileCache) -> Callable[[DcpTensor], torch.Tensor]:
    """``produce(t)``: the real tensor of ``t`` (read from its fragments, cast, checked against the plan)."""
    import torch

    from .assemble import read_piece

    def produce(t: DcpTensor) -> torch.Tensor:
        want = getattr(torch, t.dtype)
        if t.piece is None:
            assert t.value is not None
            out = torch.tensor(t.value, dtype=want)
        else:
            out = read_piece(t.piece, t.shape, cache, name=t.name)
            if out.dtype != want:
                out = out.to(want)
        assert tuple(out.shape) == t.shape and out.dtype == want, f"{t.fqn}: produced {out.dtype} {tuple(out.shape)}"
        return out

    return produce


def _copied_source(t: DcpTensor, cache: FileCache) -> StreamedTensor | None:
    """``t`` as byte ranges of the checkpoint's files when its bytes are stored as they are written (same dtype,
    contiguous fragments tiling it in order: a ZeRO partition's slices of a master or moment, a buffer), else None
    (a cast or a strided fragment: produced through torch). Reads no tensor data."""
    from .chunks import check_numel, check_tiling
    from .model import ZERO_FILL
    from .writers.torch_stream import Extent, StreamedTensor, element_nbytes

    piece = t.piece
    if piece is None or piece.dtype != t.dtype or any(f.strided or f.file == ZERO_FILL for f in piece.fragments):
        return None
    numel = check_numel(piece, t.shape, t.name)
    check_tiling(piece, numel, t.name)
    item = element_nbytes(t.dtype)
    extents: list[Extent] = []
    pos = 0
    for f in sorted(piece.fragments, key=lambda f: f.dst_offset):
        ref = cache.tensor(f.file, f.key)
        if ref.dtype_name != t.dtype or not ref.is_contiguous() or f.dst_offset != pos:
            return None
        first = ref.storage_offset + f.src_offset
        if f.src_offset < 0 or f.src_offset + f.numel > ref.numel or first + f.numel > ref.storage.numel:
            raise CorruptCheckpointError(
                f"{f.file}: tensor '{t.name}' needs elements [{f.src_offset}, {f.src_offset + f.numel}) of a stored "
                f"tensor with {ref.numel}; the checkpoint metadata does not match its tensors")
        ext = Extent(Path(ref.storage.path), ref.storage.file_offset + first * item, f.numel * item,
                     ref.storage.check, first * item)
        last = extents[-1] if extents else None
        if last is not None and last.path == ext.path and last.record is ext.record \
                and last.file_offset + last.nbytes == ext.file_offset:
            extents[-1] = Extent(last.path, last.file_offset, last.nbytes + ext.nbytes, last.record,
                                 last.record_offset)
        else:
            extents.append(ext)
        pos += f.numel
    return StreamedTensor(t.dtype, t.shape, tuple(extents))


#: Files of OUT written at once by default (one writer thread each, with a reader thread): each copies its tensors'
#: bytes from the checkpoint in a few 512 KiB buffers, one tensor after another.
DEFAULT_WORKERS = 4


def _bins(sizes: list[int], n: int) -> list[list[int]]:
    """The indices of ``sizes`` in at most ``n`` non-empty bins of nearly equal total (largest first onto the
    emptiest bin), each bin in its items' order."""
    bins: list[list[int]] = [[] for _ in range(max(1, n))]
    totals = [0] * len(bins)
    for i in sorted(range(len(sizes)), key=lambda i: -sizes[i]):
        k = min(range(len(bins)), key=totals.__getitem__)
        bins[k].append(i)
        totals[k] += sizes[i]
    return [sorted(b) for b in bins if b]


#: DCP's file names: ``{prefix}{i}{suffix}``, the prefix ``__{rank}_`` (torch 2.4-2.13 filesystem.py
#: prepare_global_plan and DEFAULT_SUFFIX); one process is rank 0.
_SUFFIX = ".distcp"


#: The GIL switch interval while DCP is imported and the files are being copied (CPython's default is 5 ms). On the
#: 2-core bench machine, 1.2 GB: 0.5-1.0 GB copied during the 4 s import with it, 0.5-0.8 GB without.
_IMPORT_SWITCH_INTERVAL_S = 0.0005


def _rank_prefix(rank: int) -> str:
    return f"__{rank}_"


class _DataFiles:
    """The tensors of ``tensors`` being written into ``folder`` by one thread per file, ``{prefix}{k}.distcp`` for
    k < ``workers`` (bins of nearly equal bytes): each tensor in ``torch.save``'s format at its offset, as DCP's
    writer puts them, its bytes copied from the checkpoint through a few 512 KiB buffers
    (:func:`~dsckpt.writers.torch_stream.append_torch_tree`; a cast or strided tensor produced through torch first).
    Starts at once: the caller imports and runs DCP's planning meanwhile. :meth:`finish` waits, appends DCP's byte
    items to the first file, fsyncs every file once and returns where each item is."""

    def __init__(self, folder: Path, prefix: str, tensors: tuple[DcpTensor, ...], cache: FileCache,
                 on_tensor: Callable[[DcpTensor], None] | None, workers: int) -> None:
        self.folder, self.prefix = folder, prefix
        self.tensors = tensors
        self.on_tensor = on_tensor
        self._produce = _producer(cache)
        self._sources = {t.fqn: _copied_source(t, cache) for t in tensors}  # planned here: reads metadata only
        self.files = [[tensors[i] for i in b] for b in _bins([t.nbytes for t in tensors], workers)]
        self.names = [f"{prefix}{k}{_SUFFIX}" for k in range(max(1, len(self.files)))]
        self.fqn_to_range: dict[str, tuple[str, int, int]] = {}  # fqn -> (file name, offset, length)
        self.sizes = [0] * len(self.names)
        self.errors: list[BaseException] = []
        self._lock = threading.Lock()
        self._threads = [threading.Thread(target=self._write_file, args=(k,), name=f"dsckpt-dcp-{k}", daemon=True)
                         for k in range(len(self.files))]
        for th in self._threads:
            th.start()

    def _write_file(self, k: int) -> None:
        from .writers.torch_stream import append_torch_tree

        name = self.names[k]
        try:
            fd = os.open(self.folder / name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0),
                         0o644)
            try:
                pos = 0
                for t in self.files[k]:
                    if self.errors:
                        return
                    src = self._sources[t.fqn]
                    n = append_torch_tree(fd, src if src is not None else self._produce(t), base=pos)
                    with self._lock:
                        self.fqn_to_range[t.fqn] = (name, pos, n)
                    pos += n
                    if self.on_tensor is not None:
                        self.on_tensor(t)
                self.sizes[k] = pos
                if k > 0:  # the first file gets DCP's byte items after, then its fsync
                    os.fsync(fd)
            finally:
                os.close(fd)
        except BaseException as e:  # noqa: BLE001 -- raised by finish() in the calling thread
            with self._lock:
                self.errors.append(e)

    def stop(self) -> None:
        """Stop after the tensors being written (an error elsewhere); waits for the threads."""
        with self._lock:
            self.errors.append(RuntimeError("stopped"))
        for th in self._threads:
            th.join()

    def finish(self, byte_items: list[tuple[Any, Any]], synced: list[Path]) -> list[tuple[Any, tuple[str, int, int]]]:
        """Wait for the tensors; append ``byte_items`` (``(key, bytes-like)``) to the first file; fsync it (the others
        were fsync'd by their threads); returns ``(key, (file name, offset, length))`` of each byte item."""
        for th in self._threads:
            th.join()
        if self.errors:
            raise self.errors[0]
        out: list[tuple[Any, tuple[str, int, int]]] = []
        path = self.folder / self.names[0]
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND | getattr(os, "O_CLOEXEC", 0), 0o644)
        try:
            pos = self.sizes[0]
            for key, data in byte_items:
                view = memoryview(data).cast("B")
                out.append((key, (self.names[0], pos, view.nbytes)))
                pos += view.nbytes
                while view.nbytes:
                    view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        synced.extend(self.folder / n for n in self.names)
        return out


def _writer(tmp: Path, plan: DcpPlan, start: Callable[[str, tuple[DcpTensor, ...]], _DataFiles],
            synced: list[Path], started: _DataFiles | None = None) -> Any:
    """DCP's ``FileSystemWriter`` into ``tmp`` whose ``write_data`` takes the tensors' bytes from a
    :class:`_DataFiles` (``started``, or one ``start(prefix, tensors)`` makes for this rank's items)."""
    from torch.distributed.checkpoint import FileSystemWriter
    from torch.distributed.checkpoint.filesystem import _StorageInfo
    from torch.distributed.checkpoint.metadata import StorageMeta
    from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItemType
    from torch.distributed.checkpoint.storage import WriteResult
    from torch.futures import Future

    fqn_to_tensor = {t.fqn: t for t in plan.tensors}

    class _Writer(FileSystemWriter):
        """DCP's writer, files as DCP writes them with ``single_file_per_rank`` (``__{rank}_{i}.distcp``, each item
        torch.save'd at its offset) but each tensor's bytes copied from the checkpoint (:class:`_DataFiles`) rather
        than produced in memory for ``torch.save``: DCP's writer keeps every tensor of a file referenced until the
        file is closed (torch 2.11-2.13 ``_write_files_from_queue``) and ``torch.save`` computes each record's
        CRC-32 holding the GIL, so its threads write one at a time (about 0.6 GB/s on a 16-core host whatever the
        disk). ``.metadata`` names OUT, not the temp folder, as its checkpoint id."""

        def storage_meta(self) -> StorageMeta | None:
            meta = super().storage_meta()
            if meta is not None:
                meta.checkpoint_id = str(plan.output)
            return meta

        def write_data(self, save_plan: SavePlan, planner: SavePlanner) -> Future[list[WriteResult]]:
            prefix = save_plan.storage_data.prefix
            tensor_items = [w for w in save_plan.items if w.type != WriteItemType.BYTE_IO]
            byte_items = [w for w in save_plan.items if w.type == WriteItemType.BYTE_IO]
            data = started
            if data is None:
                data = start(prefix, tuple(fqn_to_tensor[w.index.fqn] for w in tensor_items))
            try:
                assert data.prefix == prefix and {w.index.fqn for w in tensor_items} == {t.fqn for t in data.tensors}, \
                    "DCP planned other tensors than those being written"
                blobs = []
                for w in byte_items:  # a param group's value, torch.save'd by the planner
                    buf = planner.resolve_data(w)
                    assert isinstance(buf, io.BytesIO), f"{w.index.fqn}: a byte item resolved to {type(buf)}"
                    blobs.append((w, buf.getbuffer()))
                placed = data.finish(blobs, synced)
            except BaseException:
                data.stop()
                raise
            results = [WriteResult(index=w.index, size_in_bytes=rng[2], storage_data=_StorageInfo(*rng))
                       for w in tensor_items for rng in (data.fqn_to_range[w.index.fqn],)]
            results += [WriteResult(index=w.index, size_in_bytes=rng[2], storage_data=_StorageInfo(*rng))
                        for w, rng in placed]
            fut: Future[list[WriteResult]] = Future()
            fut.set_result(results)
            return fut

    # sync_files False: DCP's own fsync is only .metadata's (the data files are fsync'd by _DataFiles); atomic_dir
    # fsyncs it with the folders.
    return _Writer(tmp, single_file_per_rank=True, sync_files=False)


def run_to_dcp(plan: DcpPlan, cache: FileCache, *, force: bool = False,
               on_tensor: Callable[[DcpTensor], None] | None = None, workers: int = DEFAULT_WORKERS) -> DcpResult:
    """Write ``plan`` to its OUT folder atomically, ``workers`` files at once (each tensor's bytes copied from the
    checkpoint through a few small buffers: memory stays flat); every input record's CRC-32 is checked before the
    folder is moved into place. Durable when it returns, with one fsync per file and per folder."""
    synced: list[Path] = []
    with claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound), \
            atomic_dir(plan.output, synced=synced) as tmp:
        save_dcp_into(tmp, plan, cache, on_tensor=on_tensor, workers=workers, synced=synced)
        cache.finish_checks()
        names = sorted(p.name for p in tmp.iterdir())
    return DcpResult(plan, tuple(plan.output / n for n in names))


def save_dcp_into(folder: Path, plan: DcpPlan, cache: FileCache, *,
                  on_tensor: Callable[[DcpTensor], None] | None = None, workers: int = DEFAULT_WORKERS,
                  synced: list[Path] | None = None) -> None:
    """Write ``plan``'s DCP files into ``folder``, an empty folder inside the caller's atomic output (``.metadata``
    names ``plan.output``), in this process alone. The tensors' bytes start streaming into ``workers`` files at once,
    while DCP is imported and plans (DCP's planner gives one process every item); each data file is fsync'd once and
    appended to ``synced`` (for :func:`dsckpt.atomic.atomic_dir`), ``.metadata`` is not (the caller's atomic_dir
    does it). The caller completes ``cache``'s CRC checks."""
    def start(prefix: str, tensors: tuple[DcpTensor, ...]) -> _DataFiles:
        return _DataFiles(folder, prefix, tensors, cache, on_tensor, workers)

    data = start(_rank_prefix(0), plan.tensors)
    try:
        # While the import runs Python (seconds where no bytecode is kept), the copying threads need the GIL back
        # after each read, CRC and write of a 512 KiB buffer, and would wait up to the switch interval (5 ms) for it
        # every time: a shorter one lets them copy meanwhile.
        interval = sys.getswitchinterval()
        sys.setswitchinterval(min(interval, _IMPORT_SWITCH_INTERVAL_S))
        try:
            import torch.distributed.checkpoint as dcp
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner
        finally:
            sys.setswitchinterval(interval)

        writer = _writer(folder, plan, start, [] if synced is None else synced, started=data)
        with warnings.catch_warnings():  # "torch.distributed is disabled ...": one process is what is asked
            warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
            dcp.save(plan.state_dict(), storage_writer=writer, planner=DefaultSavePlanner(), no_dist=True)
    except BaseException:
        data.stop()
        raise


def run_to_dcp_distributed(plan: DcpPlan, cache: FileCache, group: Any, *, force: bool = False,
                           on_tensor: Callable[[DcpTensor], None] | None = None,
                           workers: int = DEFAULT_WORKERS) -> DcpResult:
    """:func:`run_to_dcp` over the ranks of ``group`` (:class:`dsckpt.distributed.Group`): rank 0 claims OUT and
    makes a leased temp folder; every rank runs ``dcp.save`` on the default (gloo) process group with the same
    shape-only state dict, and DCP's planner gives each tensor to one rank, balancing bytes; each rank fsyncs the
    files it wrote and completes the CRC-32 checks of what it read; rank 0 moves the folder into place once every
    rank succeeded (fsyncing every file again: it cannot tell what another rank's fsync made durable)."""
    import contextlib

    import torch.distributed.checkpoint as dcp

    group.agree(describe_dcp_plan(plan), "the to-dcp plan")
    with contextlib.ExitStack() as stack:
        def claim() -> str | None:
            if not group.is_root:
                return None
            stack.enter_context(claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound))
            return str(stack.enter_context(atomic_dir(plan.output, leased=True)))

        tmp = Path(group.step(claim, "claiming OUT")[0])

        def write() -> None:
            from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

            def start(prefix: str, tensors: tuple[DcpTensor, ...]) -> _DataFiles:
                return _DataFiles(tmp, prefix, tensors, cache, on_tensor, workers)

            dcp.save(plan.state_dict(), storage_writer=_writer(tmp, plan, start, []), planner=DefaultSavePlanner())
            cache.finish_checks()

        group.step(write, "writing the DCP folder")
        names = sorted(p.name for p in tmp.iterdir()) if group.is_root else []
    group.barrier()  # rank 0 has renamed the folder into place
    return DcpResult(plan, tuple(plan.output / n for n in names))
