"""``to-fp32``: consolidate a checkpoint into one state dict file (or shards), one tensor at a time.

OUT's suffix picks the format (:data:`SUFFIX_TO_FORMAT`): ``.safetensors``, ``.bin``/``.pt``/``.pth`` (a torch state
dict), ``.ckpt`` (a Lightning checkpoint: ``state_dict`` plus Lightning's client state, see :mod:`dsckpt.lightning`);
a folder (no suffix, an existing folder, or a name ending in ``/``) gets Hugging Face-style shards. Any other
suffix is a usage error: it is never silently taken for a folder name.

:func:`plan_to_fp32` decides everything (names, dtypes, shapes, files) without reading tensor data;
:func:`run_to_fp32` does the I/O. Safetensors output is produced with numpy alone (torch is not
imported: that import costs more than converting a 200M-parameter checkpoint); torch files
(``.bin``/``.pt``) need torch.
"""

from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ._version import package_version
from .atomic import atomic_dir, claim_output, refuse_overlap
from .chunks import plan_piece_chunks, read_chunks
from .dtypes import dtype_info, from_float32, to_float32
from .errors import OutputWriteError, UsageError
from .hf import HfFilesPlan, copy_files, plan_export_files
from .lightning import (
    ClientStatePlan,
    client_state_tree,
    lightning_name,
    plan_client_state,
)
from .model import Kind, LogicalCheckpoint, TensorEntry
from .nonfinite import NonFinite, count_nonfinite_np
from .readers import FileCache
from .writers.safetensors import (
    ShardPlan,
    TensorSpec,
    plan_shards,
    write_safetensors_chunks,
    write_sharded_chunks,
)

if TYPE_CHECKING:
    import torch

    from .peft import AdapterExport

__all__ = [
    "SUFFIX_TO_FORMAT",
    "ConvertPlan",
    "ConvertResult",
    "NonFinite",
    "NonFiniteValuesError",
    "OutputFormat",
    "describe_convert_plan",
    "parse_dtype",
    "parse_size",
    "plan_file_ranges",
    "plan_to_fp32",
    "run_to_fp32",
    "run_to_fp32_distributed",
]

DEFAULT_MAX_SHARD_SIZE = "5GB"

logger = logging.getLogger("dsckpt")


class OutputFormat(enum.Enum):
    SAFETENSORS = "safetensors"
    SAFETENSORS_SHARDED = "safetensors-sharded"
    TORCH = "torch"
    LIGHTNING = "lightning"


#: OUT suffix -> what ``to-fp32`` writes there (a folder OUT has no suffix).
SUFFIX_TO_FORMAT = {".safetensors": OutputFormat.SAFETENSORS, ".bin": OutputFormat.TORCH, ".pt": OutputFormat.TORCH,
                    ".pth": OutputFormat.TORCH, ".ckpt": OutputFormat.LIGHTNING}


_DTYPES = {"fp32": "float32", "float32": "float32", "bf16": "bfloat16", "bfloat16": "bfloat16",
           "fp16": "float16", "float16": "float16"}


def parse_dtype(name: object) -> str:
    """``"fp32"``/``"bf16"``/``"fp16"`` (or a floating ``torch.dtype``) -> the dtype name."""
    try:
        return _DTYPES[str(name).removeprefix("torch.").lower()]
    except KeyError:
        raise UsageError(f"unknown dtype '{name}'; use fp32, bf16 or fp16") from None


_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?I?B?)\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """``"5GB"`` -> 5_000_000_000, ``"2GiB"`` -> 2 * 2**30, plain integers are bytes."""
    if isinstance(text, int):
        return text
    m = _SIZE.match(text)
    if not m:
        raise UsageError(f"cannot read size '{text}'; write it like 5GB, 500MB or 2GiB")
    number, unit = float(m[1]), m[2].upper()
    base = 1024 if "I" in unit else 1000
    power = {"": 0, "B": 0, "K": 1, "M": 2, "G": 3, "T": 4}[unit[:1] if unit[:1] in "KMGT" else ""]
    size = int(number * base**power)
    if size <= 0:
        raise UsageError(f"shard size must be positive, got '{text}'")
    return size


@dataclass(frozen=True)
class ConvertPlan:
    output: Path
    format: OutputFormat
    specs: tuple[TensorSpec, ...]
    name_to_entry: dict[str, TensorEntry]
    shards: ShardPlan | None
    metadata: dict[str, str]
    hf_files: HfFilesPlan | None = None  # model-side files copied next to the weights (see dsckpt.hf)
    tied_left_out: tuple[str, ...] = ()  # tied aliases not written, as save_pretrained does
    client_state: ClientStatePlan | None = None  # .ckpt: what is carried besides state_dict (see dsckpt.lightning)
    adapter: AdapterExport | None = None  # a PEFT run exported as an adapter folder (see dsckpt.peft)

    @property
    def total_nbytes(self) -> int:
        return sum(s.nbytes for s in self.specs)

    @property
    def output_nbytes_bound(self) -> int:
        """At most this many bytes are written: tensor data plus headers / zip records."""
        hf = self.hf_files.nbytes if self.hf_files is not None else 0
        if self.client_state is not None:  # its tensors are small trainer values; its pickle is metadata
            hf += sum(f.stat().st_size for f in (self.client_state.source,))
        return self.total_nbytes + hf + 4096 + sum(256 + 2 * len(s.name.encode()) for s in self.specs)


@dataclass(frozen=True)
class ConvertResult:
    plan: ConvertPlan
    files: tuple[Path, ...]
    nonfinite: tuple[NonFinite, ...] = field(default_factory=tuple)


class NonFiniteValuesError(UsageError):
    """``--strict``: the checkpoint holds inf/NaN values; nothing was written."""

    exit_code = 1


def output_format(output: Path, *, sharded: bool, folder: bool = False) -> OutputFormat:
    """What ``to-fp32`` writes at ``output``; ``folder``: the user wrote it with a trailing ``/``."""
    suffix = output.suffix.lower()
    fmt = SUFFIX_TO_FORMAT.get(suffix)
    if fmt is OutputFormat.SAFETENSORS and sharded:
        raise UsageError(
            f"--max-shard-size needs a directory output, not the file '{output}'; "
            "give a folder name to get model-0000X-of-0000N.safetensors shards and an index"
        )
    if fmt is not None:
        if sharded:
            raise UsageError("--max-shard-size is for safetensors output; give a directory")
        if output.is_dir():
            raise UsageError(
                f"'{output}' is a folder, and a {suffix} OUT is one file; name a file that is not a folder"
                + (" (a Lightning checkpoint folder such as epoch=0-step=3.ckpt/ is what to-fp32 reads, not an output)"
                   if fmt is OutputFormat.LIGHTNING else ""))
        return fmt
    if output.exists() and not output.is_dir():
        raise UsageError(f"'{output}' exists and is not a directory; name a {', '.join(SUFFIX_TO_FORMAT)} file "
                         "or a folder")
    if suffix and not folder and not output.is_dir():
        known = ", ".join(SUFFIX_TO_FORMAT)
        raise UsageError(
            f"unknown output suffix '{output.suffix}' in '{output}'; to-fp32 writes {known} files "
            "(.safetensors: one file; .bin/.pt/.pth: a torch state dict; .ckpt: a Lightning checkpoint), "
            "or a folder of safetensors shards (a name without a suffix, an existing folder, or one ending in '/')")
    return OutputFormat.SAFETENSORS_SHARDED


def _output_dtype(entry: TensorEntry, dtype: str) -> str:
    stored = entry.source_for_fp32().dtype
    return dtype if dtype_info(stored).is_floating else stored


def plan_to_fp32(ckpt: LogicalCheckpoint, output: str | os.PathLike[str], *, dtype: str | torch.dtype = "float32",
                 exclude_frozen: bool = False, max_shard_size: str | int | None = None,
                 hf_files: bool = True, client_state: bool = True, cache: FileCache | None = None) -> ConvertPlan:
    """Decide what ``to-fp32`` writes where. Pure: reads no tensor data, writes nothing.

    ``dtype`` (``"float32"``, ``"bfloat16"``, ``"float16"`` or a torch dtype) applies to floating
    tensors; integer buffers keep theirs.

    Hugging Face export: when ``output`` is a folder, ``hf_files`` is true and the checkpoint's save
    dir is a Trainer / model folder (it holds ``config.json`` or ``trainer_state.json``), the plan
    copies its model-side files (:func:`dsckpt.hf.plan_export_files`) next to the weights and, as
    ``save_pretrained`` does, leaves tied aliases out (``lm_head.weight`` when tied to the input
    embeddings): ``from_pretrained`` re-ties them. Otherwise every name is written, aliases included.

    Lightning export (``output`` ending in ``.ckpt``): the plan names the client state carried from rank 0's
    model-states file (:func:`dsckpt.lightning.plan_client_state`, which reads pickle metadata through ``cache``),
    unless ``client_state`` is false; state-dict names lose Lightning < 2.1's ``_forward_module.`` prefix, as
    Lightning's converter does."""
    out = Path(output)
    # OUT inside the checkpoint, the checkpoint itself or a folder holding it (a run folder): with --force the old
    # OUT is moved aside and deleted, and with it the input
    refuse_overlap(out, ckpt.root, "write outside the checkpoint folder (and not onto the run folder holding it)")
    dtype = parse_dtype(dtype)
    fmt = output_format(out, sharded=max_shard_size is not None,
                        folder=str(output).endswith(("/", os.sep)))
    if not client_state and fmt is not OutputFormat.LIGHTNING:
        raise UsageError("--no-client-state is for a Lightning export (OUT ending in .ckpt); other formats never "
                         "carry client state")
    # Values depend on an open binding only where the choices give different fp32 values (16-bit stage 0
    # with masters not exactly representable); which params are frozen always depends on it.
    ckpt.require_unambiguous("to-fp32 --exclude-frozen" if exclude_frozen else "to-fp32",
                             values=True, flags=exclude_frozen)
    chosen = [e for e in ckpt.entries if not (exclude_frozen and e.kind is Kind.PARAM and not e.trainable)]
    hf = None
    tied_left_out: tuple[str, ...] = ()
    if fmt is OutputFormat.SAFETENSORS_SHARDED and hf_files:
        from .layout import list_tags
        from .peft import read_adapter_config

        adapter_cfg = read_adapter_config(ckpt.root)
        if adapter_cfg is not None:
            return _plan_adapter(ckpt, out, adapter_cfg, dtype, max_shard_size, frozenset(list_tags(ckpt.root)))
        hf = plan_export_files(ckpt.root, tag_dirs=frozenset(list_tags(ckpt.root)), dtype=dtype)
        if hf is not None:
            # The HF model's own names and layouts where the training engine renamed or re-stacked tensors
            # (AutoEP's experts.w1/w2/w3 and router: dsckpt.autoep.hf_model_view; the identity otherwise).
            from .autoep import hf_model_view

            ckpt = hf_model_view(ckpt)
            chosen = [e for e in ckpt.entries if not (exclude_frozen and e.kind is Kind.PARAM and not e.trainable)]
            tied_left_out = tuple(e.name for e in chosen if e.tied_to is not None)
            chosen = [e for e in chosen if e.tied_to is None]
    name_to_entry = {e.name: e for e in chosen}
    client: ClientStatePlan | None = None
    if fmt is OutputFormat.LIGHTNING:
        name_to_entry = {lightning_name(e.name): e for e in chosen}
        if len(name_to_entry) != len(chosen):
            raise UsageError(f"state-dict names collide once '_forward_module.' is removed in {ckpt.tag_dir}; "
                             "export .safetensors or .pt instead")
        if client_state:
            client = plan_client_state(ckpt, cache if cache is not None else FileCache())
    specs = tuple(TensorSpec(n, _output_dtype(e, dtype), e.shape) for n, e in name_to_entry.items())
    shards = None
    if fmt is OutputFormat.SAFETENSORS_SHARDED:
        shards = plan_shards(specs, parse_size(max_shard_size or DEFAULT_MAX_SHARD_SIZE))
    return ConvertPlan(out, fmt, specs, name_to_entry, shards, _metadata(ckpt), hf, tied_left_out, client)


def _metadata(ckpt: LogicalCheckpoint) -> dict[str, str]:
    return {
        "format": "pt",
        "dsckpt_version": package_version(),
        "source_tag": ckpt.tag,
        "deepspeed_version": ckpt.ds_version or "unknown",
        "zero_stage": str(ckpt.zero_stage),
        "training_precision": ckpt.precision.value,
    }


def _plan_adapter(ckpt: LogicalCheckpoint, out: Path, cfg: Any, dtype: str, max_shard_size: str | int | None,
                  tag_dirs: frozenset[str]) -> ConvertPlan:
    """A PEFT run (``adapter_config.json`` in the save dir) exported to a folder: ``adapter_model.safetensors`` with
    PEFT's keys (see :mod:`dsckpt.peft`), ``adapter_config.json`` and the model-side files."""
    from .peft import plan_adapter_export, plan_adapter_files

    if max_shard_size is not None:
        raise UsageError("a PEFT adapter is one file (adapter_model.safetensors); drop --max-shard-size, or pass "
                         "--no-hf-files for the raw state dict in shards")
    export = plan_adapter_export(ckpt, cfg)
    specs = tuple(TensorSpec(k, _output_dtype(e, dtype), e.shape) for k, e in export.key_to_entry.items())
    shards = plan_shards(specs, None, prefix="adapter_model")
    return ConvertPlan(out, OutputFormat.SAFETENSORS_SHARDED, specs, dict(export.key_to_entry), shards,
                       _metadata(ckpt), plan_adapter_files(ckpt.root, tag_dirs=tag_dirs), (), None, export)


def run_to_fp32(plan: ConvertPlan, cache: FileCache, *, force: bool = False, strict: bool = False,
                on_tensor: Callable[[TensorSpec], None] | None = None, workers: int = 1) -> ConvertResult:
    """Write the plan's output atomically and report non-finite tensors.

    With ``strict``, the first non-finite tensor aborts the write (nothing is left behind) and
    :class:`NonFiniteValuesError` lists every non-finite tensor found so far.

    Safetensors outputs are streamed: each tensor is read in bounded chunks straight from its
    fragments, checked and written, so memory stays at ``workers + 1`` chunk buffers whatever the
    model or tensor size; ``workers`` reader threads run ahead of the writer (0: read in this
    thread). Lightning (.ckpt) outputs stream the same way into a torch zip file
    (:func:`dsckpt.writers.torch_stream.write_torch_tree`): the client state first (its tensors copied byte for
    byte), then ``state_dict``. Torch (.bin/.pt) outputs hold the whole state dict in memory.

    Every zip record read is checked against its CRC-32 (:mod:`dsckpt.crc`); the checks of records
    read only partly are completed after the last tensor is produced, before the output is moved
    into place, so a damaged input leaves nothing behind.
    """
    with claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound):
        return _run_to_fp32(plan, cache, strict=strict, on_tensor=on_tensor, workers=workers)


def _run_to_fp32(plan: ConvertPlan, cache: FileCache, *, strict: bool,
                 on_tensor: Callable[[TensorSpec], None] | None, workers: int) -> ConvertResult:
    found: list[NonFinite] = []
    if not plan.specs:
        cache.finish_checks()

    record = _nonfinite_recorder(found, strict=strict)

    def produce(spec: TensorSpec) -> torch.Tensor:
        import torch

        from .assemble import read_entry
        from .scan import count_nonfinite

        t = read_entry(plan.name_to_entry[spec.name], cache)
        record(spec.name, count_nonfinite(t), t.numel())
        want = getattr(torch, spec.dtype)
        return t.to(want) if t.dtype != want else t

    if plan.format is OutputFormat.TORCH:
        from .writers.torch_stream import verify_torch_file
        from .writers.torchfile import write_torch

        def tensors():  # type: ignore[no-untyped-def]
            for spec in plan.specs:
                yield spec.name, produce(spec)
                if on_tensor is not None:
                    on_tensor(spec)
            cache.finish_checks()  # write_torch has every tensor now and has not opened its output yet

        torch_file = write_torch(plan.output, tensors(),
                                 check=lambda tmp: verify_torch_file(tmp, plan.specs, target=plan.output))
        return ConvertResult(plan, (torch_file,), tuple(found))

    order = plan.specs if plan.shards is None else tuple(s for shard in plan.shards.shards for s in shard)
    last = order[-1].name if order else None
    _produce_chunks, stream = _chunk_producer(plan, cache, order, produce, record, workers)

    def produce_chunks(spec: TensorSpec) -> Iterator[Any]:
        yield from _produce_chunks(spec)
        if spec.name == last:  # still inside the writer's atomic block: a damaged record leaves no output
            cache.finish_checks()

    files: tuple[Path, ...]
    try:
        if plan.format is OutputFormat.LIGHTNING:
            from .writers.torch_stream import ChunkedTensor, verify_torch_file, write_torch_tree

            def chunks_of(spec: TensorSpec) -> Callable[[], Iterator[Any]]:
                def chunks() -> Iterator[Any]:
                    written = 0
                    for chunk in produce_chunks(spec):
                        data = _as_bytes(chunk)
                        written += data.nbytes
                        yield data
                    if written != spec.nbytes:
                        raise AssertionError(f"{spec.name}: produced {written} bytes, planned {spec.nbytes}")
                    if on_tensor is not None:
                        on_tensor(spec)
                return chunks

            tree = client_state_tree(plan.client_state, cache) if plan.client_state is not None else {}
            tree["state_dict"] = {s.name: ChunkedTensor(s.dtype, s.shape, chunks_of(s)) for s in plan.specs}
            keys = tuple(tree)
            files = (write_torch_tree(plan.output, tree, check=lambda tmp: verify_torch_file(
                tmp, plan.specs, keys=keys, target=plan.output)),)
        elif plan.format is OutputFormat.SAFETENSORS:
            files = (write_safetensors_chunks(plan.output, plan.specs, produce_chunks, metadata=plan.metadata,
                                              on_tensor=on_tensor),)
        else:
            assert plan.shards is not None
            with atomic_dir(plan.output) as tmp:
                written = write_sharded_chunks(tmp, plan.shards, produce_chunks, metadata=plan.metadata,
                                               on_tensor=on_tensor)
                if plan.hf_files is not None:
                    written += copy_files(plan.hf_files, tmp)
            files = tuple(plan.output / p.name for p in written)
    finally:
        stream.close()
    return ConvertResult(plan, files, tuple(found))


def _chunk_producer(plan: ConvertPlan, cache: FileCache, order: tuple[TensorSpec, ...],
                    produce: Callable[[TensorSpec], Any], record: Callable[[str, tuple[int, int, int], int], None],
                    workers: int) -> tuple[Callable[[TensorSpec], Iterator[Any]], Any]:
    """``(produce_chunks, stream)``: ``produce_chunks(spec)`` yields the chunks of each tensor of ``order``
    (to be asked for in that order), read ahead by ``workers`` threads from ``stream`` (close it after)."""
    name_to_reads = {
        spec.name: plan_piece_chunks(plan.name_to_entry[spec.name].source_for_fp32(), spec.shape, cache,
                                     name=spec.name)
        for spec in order
    }
    stream = read_chunks([r for spec in order for r in name_to_reads[spec.name] or ()], workers=workers)

    def produce_chunks(spec: TensorSpec) -> Iterator[Any]:
        reads = name_to_reads[spec.name]
        if reads is None:  # strided or out-of-order fragments: whole tensor, through torch
            yield produce(spec).reshape(-1)
            return
        counts = [0, 0, 0]
        for expected in reads:
            item, raw = next(stream)
            assert item is expected, f"streamed {item.name} while writing {spec.name}"
            chunk, bad = convert_chunk(raw, item.ref.dtype_name, spec.dtype)
            for i, n in enumerate(bad):
                counts[i] += n
            yield chunk
        record(spec.name, (counts[0], counts[1], counts[2]), plan.name_to_entry[spec.name].numel)

    return produce_chunks, stream


def _nonfinite_recorder(found: list[NonFinite], *, strict: bool) -> Callable[[str, tuple[int, int, int], int], None]:
    """``record(name, (nan, posinf, neginf), numel)``: appends a :class:`NonFinite` to ``found`` for a tensor with
    non-finite values; with ``strict`` raises :class:`NonFiniteValuesError` instead of going on."""
    def record(name: str, counts: tuple[int, int, int], numel: int) -> None:
        if not any(counts):
            return
        bad = NonFinite(name, *counts, numel)
        found.append(bad)
        if strict:
            raise NonFiniteValuesError(
                f"non-finite values in {bad.describe()}; nothing was written. "
                "Run 'dsckpt scan' to see all of them and 'dsckpt repair' to fix them")
    return record


def _as_bytes(chunk: Any) -> np.ndarray:
    """A 1-D numpy chunk, or a torch tensor from the whole-tensor path, as its raw bytes (1-D uint8)."""
    if isinstance(chunk, np.ndarray):
        return np.ascontiguousarray(chunk).reshape(-1).view(np.uint8)
    import torch

    return chunk.contiguous().reshape(-1).view(torch.uint8).numpy()


def convert_chunk(raw: np.ndarray, src: str, dst: str) -> tuple[np.ndarray, tuple[int, int, int]]:
    """Cast a chunk of ``src`` bytes (see :mod:`dsckpt.dtypes`) to ``dst``, counting NaN/+inf/-inf.

    Widening bf16/fp16 to fp32 is exact; narrowing rounds to nearest even, as torch does."""
    if not dtype_info(src).is_floating:
        return raw, (0, 0, 0)
    x = to_float32(raw, src) if src in ("bfloat16", "float16", "float32") else raw
    bad = count_nonfinite_np(x)
    if src == dst:
        return raw, bad
    if x.dtype != np.float32:
        x = x.astype(np.float32)
    return from_float32(x, dst), bad


# --------------------------------------------------------------------------------------------
# --distributed

#: Boundaries of the byte ranges that ranks write into one .safetensors file fall on multiples of this: whole
#: pages and parallel-filesystem stripes, so two ranks (two clients) never write into the same page.
DIST_ALIGN_NBYTES = 1 << 20


def dist_align_nbytes() -> int:
    """:data:`DIST_ALIGN_NBYTES`, or ``DSCKPT_DIST_ALIGN_NBYTES`` (e.g. the filesystem's stripe size)."""
    try:
        return max(1, int(os.environ.get("DSCKPT_DIST_ALIGN_NBYTES", DIST_ALIGN_NBYTES)))
    except ValueError:
        return DIST_ALIGN_NBYTES


def plan_file_ranges(total_nbytes: int, world_size: int, *,
                     align_nbytes: int | None = None) -> tuple[tuple[int, int], ...]:
    """Cut a file of ``total_nbytes`` into ``world_size`` contiguous byte ranges ``[lo, hi)``, rank ``r``
    taking the ``r``-th, as equal as ``align_nbytes`` boundaries allow (default :func:`dist_align_nbytes`;
    a range may be empty). Pure but for that default."""
    if align_nbytes is None:
        align_nbytes = dist_align_nbytes()
    bounds = [0]
    for r in range(1, world_size):
        bounds.append(max(bounds[-1], min(total_nbytes, (total_nbytes * r // world_size) // align_nbytes
                                          * align_nbytes)))
    bounds.append(total_nbytes)
    return tuple((bounds[r], bounds[r + 1]) for r in range(world_size))


def describe_convert_plan(plan: ConvertPlan) -> dict[str, Any]:
    """What every rank must agree on (``Group.agree``): output, format, tensors, files, metadata."""
    return {"output": str(plan.output), "format": plan.format.value,
            "specs": [[s.name, s.dtype, list(s.shape)] for s in plan.specs],
            "shards": None if plan.shards is None else [[f, [s.name for s in sh]]
                                                         for f, sh in zip(plan.shards.filenames, plan.shards.shards)],
            "metadata": plan.metadata, "align": dist_align_nbytes(),
            "hf_files": None if plan.hf_files is None else [str(c) for c in plan.hf_files.describe()]}


def run_to_fp32_distributed(plan: ConvertPlan, cache: FileCache, group: Any, *, force: bool = False,
                            strict: bool = False, on_tensor: Callable[[TensorSpec], None] | None = None,
                            workers: int = 1) -> ConvertResult:
    """:func:`run_to_fp32` spread over the ranks of ``group`` (:class:`dsckpt.distributed.Group`); the
    output is byte for byte the one-process output, and appears only if every rank succeeded.

    * rank 0 claims OUT (lock, leftovers of killed runs, free space) and creates the temp output beside
      it, named as leased and touched every few seconds (:func:`dsckpt.atomic.lease`), so a dead run's
      temp is recognised from any host;
    * a folder OUT: the shards are split over the ranks by bytes (:func:`dsckpt.distributed.split_by_nbytes`);
      each rank writes, fsyncs and re-opens its shards in the shared temp folder and reports each one's
      size and CRC-32. A ``.safetensors`` OUT: the header is known from the plan, so each rank writes one
      contiguous byte range of the file (:func:`plan_file_ranges`) at its offset, fsyncs it and reports its
      size and CRC-32;
    * every input record's CRC-32 is completed (each record by one rank, from every rank's segments);
    * rank 0 checks that every planned byte was reported written, with the planned sizes and what the
      filesystem shows, writes the index and the Hugging Face files, re-opens a single file's header, and
      renames the temp output into place: the one step that makes OUT appear.

    A failure on any rank (or a rank lost) makes every rank raise; rank 0 then removes the temp output.
    Torch (.bin/.pt) and Lightning (.ckpt) outputs are one pickle-framed stream: not supported here."""
    import contextlib

    from . import crc as crc_mod
    from .atomic import lease, leased_temp, replace_into_place
    from .distributed import export_segments, owned_checks, record_checks, split_by_nbytes
    from .writers.safetensors import (
        chunk_bytes,
        header_bytes,
        verify_safetensors,
        write_shard_index,
    )

    if plan.format not in (OutputFormat.SAFETENSORS, OutputFormat.SAFETENSORS_SHARDED):
        raise UsageError(f"--distributed writes safetensors output (a .safetensors file or a folder of shards), not "
                         f"{plan.format.value}; run without --distributed, or name a .safetensors file or a folder")
    group.agree(describe_convert_plan(plan), "the to-fp32 plan")
    sharded = plan.format is OutputFormat.SAFETENSORS_SHARDED
    found: list[NonFinite] = []
    spec_index = {s.name: i for i, s in enumerate(plan.specs)}

    record = _nonfinite_recorder(found, strict=strict)

    def produce(spec: TensorSpec) -> Any:
        import torch

        from .assemble import read_entry
        from .scan import count_nonfinite

        t = read_entry(plan.name_to_entry[spec.name], cache)
        record(spec.name, count_nonfinite(t), t.numel())
        want = getattr(torch, spec.dtype)
        return t.to(want) if t.dtype != want else t

    checks = record_checks(cache)
    rank, world = group.rank, group.world_size
    header = b"" if sharded else header_bytes(plan.specs, plan.metadata)
    total = len(header) + plan.total_nbytes

    with contextlib.ExitStack() as stack:
        def claim() -> str | None:
            if not group.is_root:
                return None
            stack.enter_context(claim_output(plan.output, force=force, nbytes=plan.output_nbytes_bound))
            if sharded:
                tmp = stack.enter_context(atomic_dir(plan.output, leased=True))
            else:
                tmp = leased_temp(plan.output, directory=False)
                stack.callback(lambda: tmp.unlink(missing_ok=True))  # gone once renamed into place
                os.truncate(tmp, total)
                stack.enter_context(lease(tmp))  # (atomic_dir holds a folder's lease itself)
            return str(tmp)

        tmp = Path(group.step(claim, "claiming OUT")[0])

        def write_shards() -> dict[str, tuple[int, int]]:
            assert plan.shards is not None
            mine = split_by_nbytes([sum(s.nbytes for s in sh) for sh in plan.shards.shards], world)[rank]
            order = tuple(s for i in mine for s in plan.shards.shards[i])
            produce_chunks, stream = _chunk_producer(plan, cache, order, produce, record, workers)
            out: dict[str, tuple[int, int]] = {}
            try:
                for i in mine:
                    name, shard = plan.shards.filenames[i], plan.shards.shards[i]
                    state = [0, 0]  # CRC-32, bytes

                    def on_bytes(data: memoryview, state: list[int] = state) -> None:
                        state[0] = crc_mod.crc32(data, state[0])
                        state[1] += data.nbytes

                    write_safetensors_chunks(tmp / name, shard, produce_chunks, metadata=plan.metadata,
                                             on_tensor=on_tensor, on_bytes=on_bytes, make_parent=False)
                    out[name] = (state[1], state[0])
            finally:
                stream.close()
            return out

        def write_range() -> dict[str, tuple[int, int]]:
            lo, hi = plan_file_ranges(total, world)[rank]
            if lo == hi:
                return {}
            offsets, pos = [], len(header)
            for s in plan.specs:
                offsets.append(pos)
                pos += s.nbytes
            mine = [(s, off) for s, off in zip(plan.specs, offsets) if s.nbytes and off < hi and off + s.nbytes > lo]
            produce_chunks, stream = _chunk_producer(plan, cache, tuple(s for s, _ in mine), produce, record, workers)
            fd = os.open(tmp, os.O_WRONLY)  # never O_CREAT: rank 0 made it, and removes it on failure
            crc, written = 0, 0

            def put(data: memoryview, at: int) -> None:
                nonlocal crc, written
                a, b = max(lo, at), min(hi, at + data.nbytes)
                if a >= b:
                    return
                piece = data[a - at: b - at]
                crc = crc_mod.crc32(piece, crc)
                done = 0
                while done < piece.nbytes:
                    done += os.pwrite(fd, piece[done:], a + done)
                written += piece.nbytes

            try:
                put(memoryview(header), 0)
                for spec, off in mine:
                    at = off
                    for chunk in produce_chunks(spec):
                        data = chunk_bytes(chunk, spec)
                        put(data, at)
                        at += data.nbytes
                        if at >= hi:  # the rest of this tensor is the next rank's (which counts its inf/NaN)
                            break
                    else:
                        if at != off + spec.nbytes:
                            raise AssertionError(f"{spec.name}: produced {at - off} bytes, planned {spec.nbytes}")
                        if on_tensor is not None:
                            on_tensor(spec)
                os.fsync(fd)
            finally:
                os.close(fd)
                stream.close()
            return {f"{lo}-{hi}": (written, crc)}

        def write() -> tuple[dict[str, tuple[int, int]], list[tuple[int, NonFinite]], Any]:
            parts = write_shards() if sharded else write_range()
            return parts, [(spec_index[b.name], b) for b in found], export_segments(checks)

        results = group.step(write, "writing OUT")
        group.step(lambda: crc_mod.finish(owned_checks(checks, [r[2] for r in results], group)),
                   "the CRC-32 checks of the input")
        reported = {k: v for r in results for k, v in r[0].items()}

        def finish() -> list[Path]:
            if not group.is_root:
                return []
            if sharded:
                assert plan.shards is not None
                problems = []
                for name, shard in zip(plan.shards.filenames, plan.shards.shards):
                    want = len(header_bytes(shard, plan.metadata)) + sum(s.nbytes for s in shard)
                    got = reported.get(name, (None, 0))[0]
                    on_disk = (tmp / name).stat().st_size if (tmp / name).exists() else None
                    if not (want == got == on_disk):
                        problems.append(f"{name}: planned {want} bytes, reported {got}, on disk {on_disk}")
                if problems:
                    raise OutputWriteError(f"'{plan.output}' was not written completely ({'; '.join(problems)}); "
                                           "nothing was moved into place")
                written = [tmp / n for n in plan.shards.filenames]
                if len(plan.shards.filenames) > 1:
                    written.append(write_shard_index(tmp, plan.shards, metadata=plan.metadata))
                if plan.hf_files is not None:
                    written += copy_files(plan.hf_files, tmp)
                return [plan.output / p.name for p in written]
            ranges = sorted((tuple(map(int, k.split("-"))), v) for k, v in reported.items())
            pos, whole = 0, 0
            for (lo, hi), (nbytes, crc) in ranges:
                if lo != pos or nbytes != hi - lo:
                    raise OutputWriteError(f"'{plan.output}': bytes [{pos}, {lo}) were not reported written; "
                                           "nothing was moved into place")
                whole = crc_mod.crc32_combine(whole, crc, nbytes)
                pos = hi
            if pos != total or tmp.stat().st_size != total:
                raise OutputWriteError(f"'{plan.output}': {tmp.stat().st_size} bytes on disk, {pos} reported, "
                                       f"{total} planned; nothing was moved into place")
            verify_safetensors(tmp, plan.specs, target=plan.output)
            logger.debug("%s: CRC-32 0x%08x of %d bytes written by %d ranks", plan.output, whole, total, world)
            return [plan.output]

        files = group.step(finish, "checking OUT")[0]

        def publish() -> None:
            if group.is_root:
                if not sharded:
                    replace_into_place(tmp, plan.output)
                stack.close()  # sharded: atomic_dir fsyncs and renames; then the lock is released

        group.step(publish, "moving OUT into place")
    nonfinite: dict[str, NonFinite] = {}
    for _, bad in sorted((pair for r in results for pair in r[1]), key=lambda pair: pair[0]):
        nonfinite.setdefault(bad.name, bad)
    return ConvertResult(plan, tuple(files), tuple(nonfinite.values()))
