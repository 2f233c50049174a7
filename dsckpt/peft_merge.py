"""``to-fp32 CKPT OUT/ --merge [--base BASE_DIR]``: merge a PEFT LoRA / rsLoRA / DoRA adapter into its base model,
streaming, into a Hugging Face model folder (safetensors shards + index, config and tokenizer files).

:func:`plan_merge` decides every output tensor (name, dtype, shape, shard, what it is made of: the base tensor, the
base tensor with a LoRA merged in, or a ``modules_to_save`` tensor) from file headers alone;
:func:`run_merge` writes. Memory stays at a few tensors: base tensors that no adapter touches are copied through
in bounded chunks (converted when ``dtype`` differs); a merged tensor is held whole, with its fp32 sum, only while
it is written. The arithmetic is PEFT's (see :mod:`dsckpt.peft`).

The base is BASE_DIR (safetensors, one file or shards with ``model.safetensors.index.json``; or ``pytorch_model.bin``
/ ``pytorch_model-*.bin`` with ``pytorch_model.bin.index.json``, read through :mod:`dsckpt.safe_load`), or, without
BASE_DIR, the frozen base params the checkpoint itself holds (saved without ``exclude_frozen_parameters``).
"""

from __future__ import annotations

import json
import os
import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._version import package_version
from .atomic import atomic_dir, claim_output, refuse_overlap
from .convert import DEFAULT_MAX_SHARD_SIZE, convert_chunk, parse_size
from .dtypes import DTYPES, dtype_info
from .errors import CheckpointNotFoundError, CorruptCheckpointError, UsageError
from .hf import FileCopy, FileRole, HfFilesPlan, LeftOut, copy_files, plan_export_files
from .limits import open_regular, read_small_file
from .model import Kind, LogicalCheckpoint, TensorEntry
from .peft import AdapterConfig, MergeAction, base_name, plan_merge_actions, require_base_source
from .readers import FileCache
from .writers.safetensors import ShardPlan, TensorSpec, plan_shards, write_sharded_chunks

if TYPE_CHECKING:
    import torch

__all__ = ["MergePlan", "MergeResult", "open_base", "plan_merge", "run_merge"]

CHUNK_NBYTES = 16 * 1024 * 1024
#: How far reading and merging may run ahead of the writer (plus one tensor when a merged tensor is larger).
AHEAD_NBYTES = 128 * 1024 * 1024
#: fp32 bytes of one block of rows of a LoRA merge (see _merge_rows): what is added and rounded at a time.
ROW_BLOCK_NBYTES = 16 * 1024 * 1024


@dataclass(frozen=True)
class BaseTensor:
    """One base tensor and where to read it (its own cache: a base folder, or the checkpoint)."""

    entry: TensorEntry
    cache: FileCache


@dataclass(frozen=True)
class MergePlan:
    output: Path
    config: AdapterConfig
    base: str  # what the base is, for messages: "--base DIR" or "the checkpoint's frozen params"
    specs: tuple[TensorSpec, ...]
    actions: dict[str, MergeAction]
    name_to_base: dict[str, BaseTensor]
    shards: ShardPlan
    metadata: dict[str, str]
    hf_files: HfFilesPlan | None
    notes: tuple[str, ...]
    name_to_entry: dict[str, TensorEntry]  # the checkpoint's entries (adapter tensors, modules_to_save)
    tied_left_out: tuple[str, ...] = ()

    @property
    def total_nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def output_nbytes_bound(self) -> int:
        hf = self.hf_files.nbytes if self.hf_files is not None else 0
        return (self.total_nbytes + hf + 4096 * len(self.shards.filenames)
                + sum(256 + 2 * len(s.name) for s in self.specs))


@dataclass(frozen=True)
class MergeResult:
    plan: MergePlan
    files: tuple[Path, ...]


def open_base(base_dir: str | os.PathLike[str]) -> tuple[dict[str, BaseTensor], Path]:
    """The base model's tensors (name -> where), read from file headers / pickle metadata only, and the folder."""
    from .state_dict_files import open_state_dict

    d = Path(base_dir)
    if not d.is_dir():
        raise CheckpointNotFoundError(f"--base '{d}' is not a folder; give the folder of the base model "
                                      "(config.json and model*.safetensors or pytorch_model*.bin)")
    files: list[Path]
    if (d / "model.safetensors.index.json").is_file() or list(d.glob("*.safetensors")):
        files = [d]
    elif (d / "pytorch_model.bin.index.json").is_file():
        try:
            weight_map = json.loads(read_small_file(d / "pytorch_model.bin.index.json").decode("utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptCheckpointError(f"{d / 'pytorch_model.bin.index.json'}: unreadable index ({e})") from e
        if not all(isinstance(n, str) and Path(n).name == n for n in names):
            raise CorruptCheckpointError(f"{d / 'pytorch_model.bin.index.json'}: shard names must be file names")
        files = [d / n for n in names]
    elif (d / "pytorch_model.bin").is_file():
        files = [d / "pytorch_model.bin"]
    else:
        raise CheckpointNotFoundError(f"--base '{d}' holds no model.safetensors, model-*.safetensors or "
                                      "pytorch_model*.bin")
    out: dict[str, BaseTensor] = {}
    for f in files:
        logical, cache = open_state_dict(f)
        for entry in logical.entries:
            if entry.name in out:
                raise CorruptCheckpointError(f"tensor '{entry.name}' is in two files of --base '{d}'")
            if entry.tied_to is None:
                out[entry.name] = BaseTensor(entry, cache)
    return out, d


def _base_from_checkpoint(ckpt: LogicalCheckpoint, cache: FileCache) -> tuple[dict[str, BaseTensor], tuple[str, ...]]:
    """The frozen base params (and buffers) the checkpoint holds, under the base model's names; tied aliases
    whose source is written are left out, as save_pretrained does."""
    out: dict[str, BaseTensor] = {}
    tied = []
    for e in ckpt.entries:
        name = base_name(e.name)
        if name is None or (e.kind is Kind.PARAM and e.trainable):
            continue
        if e.tied_to is not None and base_name(e.tied_to) is not None:
            tied.append(name)
            continue
        out[name] = BaseTensor(e, cache)
    return out, tuple(tied)


def plan_merge(ckpt: LogicalCheckpoint, cache: FileCache, cfg: AdapterConfig, output: str | os.PathLike[str], *,
               base_dir: str | os.PathLike[str] | None = None, dtype: str | None = None,
               max_shard_size: str | int | None = None, hf_files: bool = True,
               base_in_checkpoint: bool = False) -> MergePlan:
    """Decide the merged folder. Reads headers / pickle metadata only.

    ``dtype``: floating output tensors in this dtype; None: each in its base tensor's dtype."""
    out = Path(output)
    refuse_overlap(out, ckpt.root, "write outside the checkpoint folder (and not onto the run folder holding it)")
    if out.suffix.lower() in (".safetensors", ".bin", ".pt", ".pth", ".ckpt"):
        raise UsageError(f"--merge writes a Hugging Face model folder; name a folder for OUT, not '{out.name}'")
    if out.exists() and not out.is_dir():
        raise UsageError(f"'{out}' exists and is not a folder; --merge writes a model folder")
    require_base_source(cfg, None if base_dir is None else str(base_dir), base_in_checkpoint, ckpt)
    tied: tuple[str, ...] = ()
    if base_dir is not None:
        base, folder = open_base(base_dir)
        refuse_overlap(out, folder, "write the merged model outside the base model's folder")
        what = f"--base {folder}"
    else:
        base, tied = _base_from_checkpoint(ckpt, cache)
        folder = ckpt.root
        what = "the frozen base params in the checkpoint"
    actions, notes = plan_merge_actions(ckpt, cfg, {n: b.entry.shape for n, b in base.items()})
    specs = []
    for name, b in base.items():
        stored = b.entry.source_for_fp32().dtype
        floating = dtype_info(stored).is_floating
        specs.append(TensorSpec(name, dtype if dtype is not None and floating else stored, b.entry.shape))
    shards = plan_shards(specs, parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE))
    hf = _merge_files(folder, ckpt.root, specs) if hf_files else None
    metadata = {"format": "pt", "dsckpt_version": package_version(), "merged_adapter": cfg.variant,
                "source_tag": ckpt.tag}
    return MergePlan(out, cfg, what, tuple(specs), actions, base, shards, metadata, hf, notes,
                     {e.name: e for e in ckpt.entries}, tied)


def _merge_files(base_folder: Path, ckpt_root: Path, specs: list[TensorSpec]) -> HfFilesPlan | None:
    """Model-side files of the base (config.json with ``dtype`` set to the output's), then those of the Trainer
    folder the base lacks (tokenizer, chat template). Never ``adapter_config.json``: from_pretrained would take
    the folder for an adapter."""
    dtypes = sorted({s.dtype for s in specs if dtype_info(s.dtype).is_floating})
    out_dtype = dtypes[0] if len(dtypes) == 1 else "float32"
    from .layout import list_tags

    plans = [p for p in (plan_export_files(base_folder, dtype=out_dtype, tag_dirs=frozenset(list_tags(base_folder))),
                         None if ckpt_root == base_folder else
                         plan_export_files(ckpt_root, dtype=out_dtype, tag_dirs=frozenset(list_tags(ckpt_root)))) if p]
    if not plans and not (ckpt_root / "adapter_config.json").is_file():
        return None
    copies: list[FileCopy] = []
    left: list[LeftOut] = []
    seen: set[str] = set()
    for plan in plans:
        for c in plan.copies:
            if c.dest_name not in seen:
                seen.add(c.dest_name)
                copies.append(c)
        left += [o if o.source is None or o.source.name != "adapter_config.json" else
                 LeftOut(o.source, o.role, "the merged model is a full model, not an adapter (from_pretrained would "
                                           "take a folder holding it for an adapter)")
                 for o in plan.left_out if o.source is not None]
    if "config.json" not in seen:
        where = (f"'{base_folder}' has" if base_folder == ckpt_root else
                 f"neither '{base_folder}' nor '{ckpt_root}' has")
        left.append(LeftOut(None, FileRole.MODEL_SIDE, f"{where} no config.json; "
                                                       "AutoModelForCausalLM.from_pretrained(OUT) needs the base "
                                                       "model's: copy it into OUT, or merge with --base BASE_DIR"))
    return HfFilesPlan(base_folder, tuple(copies), tuple(left))


def run_merge(plan: MergePlan, cache: FileCache, *, force: bool = False,
              on_tensor: Callable[[TensorSpec], None] | None = None) -> MergeResult:
    """Write the merged folder atomically (every shard, the index, the model-side files, or nothing)."""
    order = [s for shard in plan.shards.shards for s in shard]
    with claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound):
        with atomic_dir(plan.output) as tmp, _Ahead(plan, cache, order) as ahead:
            written = write_sharded_chunks(tmp, plan.shards, ahead.chunks, metadata=plan.metadata,
                                           on_tensor=on_tensor)
            if plan.hf_files is not None:
                written += copy_files(plan.hf_files, tmp)
        for b in {id(b.cache): b.cache for b in plan.name_to_base.values()}.values():
            b.finish_checks()
        cache.finish_checks()
    return MergeResult(plan, tuple(plan.output / p.name for p in written))


_END = object()


class _Ahead:
    """Produces the chunks of ``order`` (read, merged, converted) in one background thread, at most
    :data:`AHEAD_NBYTES` ahead of the writer (one item more when a single tensor is larger), so that reading and
    merging overlap writing. Reads of the checkpoint and the base happen in that thread only."""

    def __init__(self, plan: MergePlan, cache: FileCache, order: list[TensorSpec]) -> None:
        self._plan, self._cache, self._order = plan, cache, order
        self._q: queue.Queue[tuple[str | None, Any]] = queue.Queue()
        self._cond = threading.Condition()
        self._ahead = 0
        self._stop = False
        self._thread = threading.Thread(target=self._run, name="dsckpt-merge", daemon=True)

    def __enter__(self) -> _Ahead:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        self._thread.join()

    def _run(self) -> None:
        try:
            for spec in self._order:
                for chunk in _produce(self._plan, self._cache, spec):
                    with self._cond:
                        while self._ahead and self._ahead + chunk.nbytes > AHEAD_NBYTES and not self._stop:
                            self._cond.wait()
                        if self._stop:
                            return
                        self._ahead += chunk.nbytes
                    self._q.put((spec.name, chunk))
                self._q.put((spec.name, _END))
        except BaseException as e:  # noqa: BLE001 - handed to the writer's thread, which raises it
            self._q.put((None, e))

    def chunks(self, spec: TensorSpec) -> Iterator[Any]:
        while True:
            name, item = self._q.get()
            if name is None:
                raise item
            assert name == spec.name, f"produced {name} while writing {spec.name}"
            if item is _END:
                return
            yield item
            with self._cond:
                self._ahead -= item.nbytes
                self._cond.notify_all()


def _produce(plan: MergePlan, cache: FileCache, spec: TensorSpec) -> Iterator[Any]:
    action = plan.actions[spec.name]
    base = plan.name_to_base[spec.name]
    if action.lora is None and action.replace_with is None:
        yield from _copy_chunks(base, spec)
        return
    import torch

    from .assemble import read_entry

    if action.replace_with is not None:
        t = read_entry(_entry(plan, action.replace_with), cache)
        want = getattr(torch, base.entry.source_for_fp32().dtype)
        t = t.to(want)  # as PEFT's unload: the trained copy, in the base model's dtype
    else:
        assert action.lora is not None
        lo = action.lora
        frags = base.entry.source_for_fp32().fragments
        if lo.magnitude is None and len(frags) == 1 and not frags[0].strided and len(base.entry.shape) == 2:
            yield from _merge_rows(plan, cache, base, spec)
            return
        w = read_entry(base.entry, base.cache)
        a = read_entry(_entry(plan, lo.a), cache).float()
        b = read_entry(_entry(plan, lo.b), cache).float()
        m = read_entry(_entry(plan, lo.magnitude), cache).float() if lo.magnitude is not None else None
        t = merge_lora(w, a, b, scaling=lo.scaling, fan_in_fan_out=lo.fan_in_fan_out, magnitude=m)
    want = getattr(torch, spec.dtype)
    yield (t.to(want) if t.dtype != want else t).contiguous().reshape(-1)


def _merge_rows(plan: MergePlan, cache: FileCache, base: BaseTensor, spec: TensorSpec) -> Iterator[Any]:
    """A LoRA merged into ``base`` a block of rows at a time: ``transpose(B @ A, f) * scaling`` is computed whole, as
    PEFT computes it (one GEMM of the same shapes: a GEMM cut into blocks may sum in another order on some BLAS
    kernels), then, for each block of about :data:`ROW_BLOCK_NBYTES` of fp32, the base rows are read, added in fp32
    and the sum rounded to the output dtype and handed to the writer. Memory: the fp32 delta and one block."""
    import torch

    from .assemble import read_entry

    lo = plan.actions[spec.name].lora
    assert lo is not None
    a = read_entry(_entry(plan, lo.a), cache).float()
    b = read_entry(_entry(plan, lo.b), cache).float()
    delta = b @ a
    delta.mul_(lo.scaling)  # in place: the same elementwise product as PEFT's `transpose(B @ A, f) * scaling`
    if lo.fan_in_fan_out:  # W is [in, out] (Conv1D)
        delta = delta.T
    frag = base.entry.source_for_fp32().fragments[0]
    ref = base.cache.tensor(frag.file, frag.key)
    rows, cols = base.entry.shape
    block = max(1, ROW_BLOCK_NBYTES // (4 * max(1, cols)))
    stored = getattr(torch, base.entry.source_for_fp32().dtype)
    want = getattr(torch, spec.dtype)
    for r0 in range(0, rows, block):
        r1 = min(rows, r0 + block)
        w = ref.read(frag.src_offset + r0 * cols, (r1 - r0) * cols, out=torch.empty((r1 - r0) * cols, dtype=stored))
        out = merge_lora_delta(w.view(r1 - r0, cols), delta[r0:r1])
        yield (out.to(want) if out.dtype != want else out).contiguous().reshape(-1)


def merge_lora_delta(w: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """``w + delta`` as PEFT's ``base_layer.weight.data += delta`` gives it: the fp32 sum rounded once to ``w``'s
    dtype. ``w`` and ``delta`` are the caller's own: the sum goes into one of them."""
    if w.dtype == delta.dtype:
        w += delta
        return w
    torch_add(delta, w)
    return delta.to(w.dtype)


def _entry(plan: MergePlan, name: str) -> TensorEntry:
    return plan.name_to_entry[name]


def merge_lora(w: torch.Tensor, a: torch.Tensor, b: torch.Tensor, *, scaling: float, fan_in_fan_out: bool,
               magnitude: torch.Tensor | None = None) -> torch.Tensor:
    """PEFT 0.21.2's merge of one LoRA (``magnitude``: DoRA) into ``w``, in ``w``'s dtype (see :mod:`dsckpt.peft`).
    ``a``, ``b``, ``magnitude`` fp32. Plain LoRA merges into ``w`` in place and returns it."""
    delta = b @ a
    delta.mul_(scaling)  # in place: the same elementwise product as PEFT's `transpose(B @ A, f) * scaling`
    if fan_in_fan_out:
        delta = delta.T
    if magnitude is None:
        # PEFT: base_layer.weight.data += delta. ``w`` is this function's own copy (just read): an fp32 ``w`` takes
        # the sum in place; a 16-bit one is summed into the fp32 delta (the same fp32 sum, which PEFT's mixed in-place
        # add computes too, 2-3x slower) and rounded once to its dtype.
        return merge_lora_delta(w, delta)
    tw = w.T if fan_in_fan_out else w
    weight = tw + 1 * (delta.T if fan_in_fan_out else delta)
    norm = torch_norm(weight)
    factor = magnitude / norm
    factor = factor.view(-1, 1)
    if fan_in_fan_out:
        factor = factor.T
    return (factor * (w + delta)).to(w.dtype)


def torch_add(acc: torch.Tensor, x: torch.Tensor) -> None:
    import torch

    torch.add(acc, x, out=acc)


def torch_norm(weight: torch.Tensor) -> torch.Tensor:
    import torch

    return torch.linalg.norm(weight, dim=1).to(weight.dtype)


def _copy_chunks(base: BaseTensor, spec: TensorSpec) -> Iterator[np.ndarray]:
    """A base tensor front to back in bounded chunks, converted to ``spec.dtype``."""
    piece = base.entry.source_for_fp32()
    frags = sorted(piece.fragments, key=lambda f: f.dst_offset)
    src = piece.dtype
    itemsize = dtype_info(src).itemsize
    step = max(1, CHUNK_NBYTES // itemsize)
    expected = 0
    for frag in frags:
        if frag.strided or frag.dst_offset != expected:
            raise CorruptCheckpointError(f"base tensor '{spec.name}' is not stored in one piece; cannot stream it")
        ref = base.cache.tensor(frag.file, frag.key)
        fd = open_regular(frag.file)  # one descriptor per tensor (a base tensor is one whole stored tensor)
        try:
            for start in range(frag.src_offset, frag.src_offset + frag.numel, step):
                n = min(step, frag.src_offset + frag.numel - start)
                raw = ref.read_numpy(start, n, out=np.empty(n, dtype=DTYPES[src].numpy), fd=fd)
                yield raw if src == spec.dtype else convert_chunk(raw, src, spec.dtype)[0]
        finally:
            os.close(fd)
        expected += frag.numel
