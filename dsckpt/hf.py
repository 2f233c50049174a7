"""The Hugging Face side of a Trainer / Accelerate checkpoint folder: which files go where.

A Trainer ``checkpoint-N/`` folder is a DeepSpeed save dir (``latest``, ``global_stepN/``) with the
Trainer's own files beside it (transformers 5.23, DeepSpeed 0.19.8)::

    config.json, generation_config.json            model side (from_pretrained needs config.json)
    tokenizer.json, tokenizer_config.json, chat_template.jinja, special_tokens_map.json, ...
    model.safetensors                              16-bit weights, only when the Trainer could gather them
    trainer_state.json, training_args.bin          Trainer side (resume reads trainer_state.json first)
    scheduler.pt, scaler.pt                        only without a DeepSpeed-side scheduler / with fp16 AMP
    rng_state_{rank}.pth                           one per process; ``rng_state.pth`` on a single process

:func:`plan_export_files` (``to-fp32``) and :func:`plan_resume_files` (``reshard``) are pure: they
list what is copied where and what is left out, and why. :func:`copy_files` copies byte for byte
(nothing is unpickled: ``training_args.bin`` is a pickled ``TrainingArguments`` object and is only
ever copied). No torch import.

An Accelerate ``save_state(output_dir)`` folder under DeepSpeed (accelerate 1.15) is a DeepSpeed save dir
with tag ``pytorch_model`` (``pytorch_model_{i}`` for further models) and Accelerate's files beside it::

    scheduler.bin, scheduler_{i}.bin               prepared torch schedulers
    sampler.bin, sampler_{i}.bin, dl_state_dict*.bin   dataloader state (seedable sampler / stateful loader)
    custom_checkpoint_{i}.pkl                      objects given to register_for_checkpointing
    scaler.pt                                      GradScaler (fp16 AMP without DeepSpeed's loss scaler)
    random_states_{process_index}.pkl              one per process, also on a single process

RNG states on a new process count (:func:`plan_resume_files`): the Trainer reads
``rng_state_{process_index}.pth`` when ``world_size > 1`` and ``rng_state.pth`` otherwise; when the
file is missing it logs "Didn't find an RNG file ..." and continues with the RNG seeded from
``TrainingArguments.seed`` (transformers ``Trainer._load_rng_state``). So: rank ``r`` keeps the
state of old rank ``r``; on one process, old rank 0's state is written as ``rng_state.pth``; new
ranks that had no state get no file (the Trainer's own behaviour when one is missing); states of
ranks that no longer exist are left out. Accelerate's ``load_state`` reads
``random_states_{process_index}.pkl`` on every process (``random_states_0.pkl`` on one) and, when it is
missing, logs "Could not load random states" and goes on (``checkpointing.load_accelerator_state``): the
same rule, with no special single-process name.
"""

from __future__ import annotations

import enum
import fnmatch
import json
import os
import re
import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from .atomic import copy_file, copy_tree
from .errors import CorruptCheckpointError
from .limits import read_small_file, regular_file

__all__ = [
    "FileCopy",
    "FileRole",
    "HfFilesPlan",
    "LeftOut",
    "classify",
    "copy_files",
    "is_accelerate_folder",
    "is_hf_folder",
    "plan_export_files",
    "plan_resume_files",
]

# transformers' save_pretrained of configs, generation configs, tokenizers and processors (5.23).
_MODEL_SIDE = (
    "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
    "added_tokens.json", "vocab.json", "vocab.txt", "merges.txt", "tokenizer.model", "spiece.model",
    "sentencepiece.bpe.model", "chat_template.jinja", "chat_template.json", "preprocessor_config.json",
    "processor_config.json", "video_preprocessor_config.json", "feature_extractor_config.json",
    # trust_remote_code models keep their code beside the config
    "configuration_*.py", "modeling_*.py", "tokenization_*.py", "processing_*.py", "image_processing_*.py",
)
_MODEL_SIDE_DIRS = ("additional_chat_templates",)
_WEIGHTS = ("model.safetensors", "model-*-of-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
            "pytorch_model-*-of-*.bin", "pytorch_model.bin.index.json", "adapter_model.safetensors",
            "adapter_model.bin")
_TRAINER_STATE = ("trainer_state.json", "training_args.bin")
# Accelerate's training-loop state (accelerate/checkpointing.py: SAMPLER_NAME, dl_state_dict, save_custom_state)
_ACCELERATE_STATE = ("custom_checkpoint_*.pkl", "sampler.bin", "sampler_*.bin", "dl_state_dict.bin",
                     "dl_state_dict_*.bin")
_OPTIMIZER = ("optimizer.pt", "optimizer.bin", "rank*-of-*-optimizer.pt", "scheduler.pt", "scheduler.bin",
              "scaler.pt", "scaler.bin", "optimizer_*.bin", "scheduler_*.bin")
_DEEPSPEED = ("latest", "latest_universal", "zero_to_fp32.py", "zero_to_torch.py")
_RNG = re.compile(r"^rng_state(?:_(\d+))?\.pth$")
_ACCELERATE_RNG = re.compile(r"^random_states_(\d+)\.pkl$")
_ACCELERATE_MARKERS = re.compile(r"^(?:random_states_\d+|custom_checkpoint_\d+)\.pkl$")


class FileRole(enum.Enum):
    MODEL_SIDE = "model-side"  # config, generation config, tokenizer, chat template, remote code
    WEIGHTS = "weights"  # model weights the Trainer wrote (16-bit under DeepSpeed)
    TRAINER_STATE = "trainer-state"  # trainer_state.json, training_args.bin; Accelerate's sampler / custom objects
    OPTIMIZER = "optimizer"  # optimizer / scheduler / scaler files
    RNG = "rng"
    DEEPSPEED = "deepspeed"  # latest, zero_to_fp32.py, tag folders
    OTHER = "other"


@dataclass(frozen=True)
class FileCopy:
    """Copy ``source`` (a file or a folder) byte for byte to ``dest_name`` inside the output."""

    source: Path
    dest_name: str
    role: FileRole
    note: str = ""
    json_updates: tuple[tuple[str, str], ...] = ()  # top-level keys rewritten (config.json "dtype" only)


@dataclass(frozen=True)
class LeftOut:
    source: Path | None  # None: a file the output would need but the input does not have
    role: FileRole
    reason: str


@dataclass(frozen=True)
class HfFilesPlan:
    folder: Path
    copies: tuple[FileCopy, ...]
    left_out: tuple[LeftOut, ...]
    client: str = "Hugging Face Trainer"  # or "Accelerate" (a save_state folder): who wrote the files

    @property
    def nbytes(self) -> int:
        """Bytes the copies take (folders counted file by file), for the free-space check."""
        total = 0
        for c in self.copies:
            paths = [c.source] if c.source.is_file() else [p for p in c.source.rglob("*") if p.is_file()]
            total += sum(p.stat().st_size for p in paths)
        return total

    def describe(self) -> list[str]:
        lines = [f"  copy {c.source.name}" + (f" -> {c.dest_name}" if c.dest_name != c.source.name else "")
                 + (f"  ({c.note})" if c.note else "") for c in self.copies]
        lines += [f"  leave out {o.source.name if o.source else ''}: {o.reason}".replace("out :", "out:")
                  for o in self.left_out]
        return lines


def _matches(name: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatchcase(name, p) for p in patterns)


def classify(path: Path, *, tag_dirs: frozenset[str] = frozenset()) -> FileRole:
    """The role of one entry of a Trainer / Accelerate folder, by name."""
    name = path.name
    if path.is_dir():
        if name in _MODEL_SIDE_DIRS:
            return FileRole.MODEL_SIDE
        return FileRole.DEEPSPEED if name in tag_dirs else FileRole.OTHER
    if _matches(name, _MODEL_SIDE):
        return FileRole.MODEL_SIDE
    if _matches(name, _WEIGHTS):
        return FileRole.WEIGHTS
    if name in _TRAINER_STATE or _matches(name, _ACCELERATE_STATE):
        return FileRole.TRAINER_STATE
    if _matches(name, _OPTIMIZER):
        return FileRole.OPTIMIZER
    if _RNG.match(name) or _ACCELERATE_RNG.match(name):
        return FileRole.RNG
    if name in _DEEPSPEED:
        return FileRole.DEEPSPEED
    return FileRole.OTHER


def is_hf_folder(root: Path) -> bool:
    """``root`` (a DeepSpeed save dir) was written by the HF Trainer or holds a model config."""
    return (root / "config.json").is_file() or (root / "trainer_state.json").is_file()


def is_accelerate_folder(root: Path) -> bool:
    """``root`` (a DeepSpeed save dir) was written by Accelerate's ``save_state``: it holds
    ``random_states_{i}.pkl`` or ``custom_checkpoint_{i}.pkl``."""
    try:
        return any(_ACCELERATE_MARKERS.match(e.name) and e.is_file() for e in os.scandir(root))
    except OSError:
        return False


def _entries(root: Path) -> list[Path]:
    return sorted((p for p in root.iterdir() if not p.name.startswith(".")), key=lambda p: p.name)


def plan_export_files(root: str | os.PathLike[str], *, tag_dirs: frozenset[str] = frozenset(),
                      dtype: str = "float32") -> HfFilesPlan | None:
    """Model-side files of the folder ``root`` to put next to exported weights (``to-fp32``), so that
    ``from_pretrained(OUT)`` works; ``None`` if ``root`` is not a Trainer / model folder.

    Files are copied byte for byte, except that ``config.json``'s ``dtype`` (``torch_dtype`` before
    transformers 4.56) is set to the exported ``dtype``, as ``save_pretrained`` would write it for
    these weights: the Trainer wrote the training dtype (``bfloat16``), and transformers 5 loads
    with ``dtype="auto"`` by default, which would silently cast an fp32 export back to bf16.

    Never copied: the Trainer's state, optimizer / scheduler / scaler and RNG files, the weights it
    wrote (the export replaces them), DeepSpeed's files. Unknown files are left out and listed."""
    root = Path(root)
    if not is_hf_folder(root):
        return None
    copies, left = [], []
    reasons = {
        FileRole.WEIGHTS: "the exported weights replace it",
        FileRole.TRAINER_STATE: "training state, not part of the model",
        FileRole.OPTIMIZER: "training state, not part of the model",
        FileRole.RNG: "training state, not part of the model",
        FileRole.DEEPSPEED: "DeepSpeed checkpoint file",
        FileRole.OTHER: "not a known model-side file; copy it by hand if the model needs it",
    }
    for p in _entries(root):
        role = classify(p, tag_dirs=tag_dirs)
        if role is FileRole.MODEL_SIDE:
            updates = _dtype_updates(p, dtype) if p.name == "config.json" else ()
            note = ", ".join(f'"{k}" set to "{v}"' for k, v in updates)
            copies.append(FileCopy(p, p.name, role, note, updates))
        else:
            left.append(LeftOut(p, role, reasons[role]))
    if not (root / "config.json").is_file():
        left.append(LeftOut(None, FileRole.MODEL_SIDE, f"'{root}' has no config.json; from_pretrained(OUT) will "
                                                       "need one (copy it from the model you trained)"))
    return HfFilesPlan(root, tuple(copies), tuple(left))


def _dtype_updates(config: Path, dtype: str) -> tuple[tuple[str, str], ...]:
    try:
        data = json.loads(read_small_file(config).decode("utf-8"))
    except (OSError, ValueError) as e:
        raise CorruptCheckpointError(f"cannot read '{config}' as JSON ({e}); fix or remove it, or pass "
                                     "--no-hf-files") from e
    if not isinstance(data, dict):
        raise CorruptCheckpointError(f"'{config}' is not a JSON object; fix or remove it, or pass --no-hf-files")
    return tuple((k, dtype) for k in ("dtype", "torch_dtype") if k in data and data[k] != dtype)


def _rng_ranks(root: Path, pattern: re.Pattern[str]) -> dict[int, Path]:
    """Old process rank -> its RNG file (``rng_state.pth`` of a single-process Trainer run is rank 0)."""
    out = {}
    for p in _entries(root):
        m = pattern.match(p.name)
        if m and p.is_file():
            out[int(m[1]) if m[1] is not None else 0] = p
    return out


def _rng_plan(rng: dict[int, Path], world_size: int, name: Callable[[int], str], single: str | None,
              missing: str) -> tuple[list[FileCopy], list[LeftOut]]:
    """New rank r gets old rank r's file ``name(r)``; with ``single`` (the Trainer's ``rng_state.pth``), one
    process gets old rank 0's file under that name; ranks without a state get none (``missing`` says what
    the client then does); states of ranks that no longer exist are left out."""
    copies: list[FileCopy] = []
    left: list[LeftOut] = []
    if not rng:
        return copies, left
    if world_size == 1 and single is not None:
        r0 = 0 if 0 in rng else min(rng)
        copies.append(FileCopy(rng[r0], single, FileRole.RNG,
                               f"rank 0's state; a single-process Trainer reads {single}" if r0 == 0
                               else f"rank {r0}'s state (there is no rank 0 file)"))
    else:
        for r in range(world_size):
            if r in rng:
                note = "" if rng[r].name == name(r) else "single-process state, as rank 0's"
                copies.append(FileCopy(rng[r], name(r), FileRole.RNG, note))
            else:
                left.append(LeftOut(None, FileRole.RNG, f"rank {r} had no RNG state: no {name(r)}, so {missing}"))
    kept = {c.source for c in copies}
    for r, p in sorted(rng.items()):
        if p not in kept:
            left.append(LeftOut(p, FileRole.RNG, f"rank {r} does not exist with {world_size} process(es)"))
    return copies, left


def plan_resume_files(root: str | os.PathLike[str], world_size: int, *, tag: str | None = None,
                      tag_dirs: frozenset[str] = frozenset()) -> HfFilesPlan | None:
    """The Trainer's (or Accelerate's) files of ``root`` to carry into a resharded save dir for
    ``world_size`` processes, so that ``Trainer.train(resume_from_checkpoint=OUT)`` (or
    ``accelerator.load_state(OUT)``) works; ``None`` if ``root`` is neither a Trainer / model folder nor an
    Accelerate ``save_state`` folder. ``tag`` is the tag folder being resharded (written by reshard);
    ``tag_dirs`` names every DeepSpeed tag folder. RNG states follow the rule in the module docstring.

    Everything except DeepSpeed's own files (written by reshard) and the RNG states is copied byte for
    byte: trainer_state.json, training_args.bin, scheduler/scaler files, config and tokenizer files,
    the 16-bit weights, Accelerate's sampler / custom-object files, and files dsckpt does not know."""
    root = Path(root)
    accelerate = is_accelerate_folder(root)
    if not is_hf_folder(root) and not accelerate:
        return None
    copies, left = [], []
    for p in _entries(root):
        role = classify(p, tag_dirs=tag_dirs)
        if role is FileRole.DEEPSPEED:
            if p.is_dir() and p.name != tag:
                left.append(LeftOut(p, role, "another DeepSpeed tag; only the resharded tag is written"))
            continue  # latest, zero_to_fp32.py: written by reshard itself
        if role is FileRole.RNG:
            continue
        copies.append(FileCopy(p, p.name, role))
    for rng, name, single, missing in (
            (_rng_ranks(root, _RNG), "rng_state_{}.pth".format, "rng_state.pth",
             "the Trainer logs \"Didn't find an RNG file\" and keeps its seeded RNG on that rank"),
            (_rng_ranks(root, _ACCELERATE_RNG), "random_states_{}.pkl".format, None,
             "Accelerate's load_state logs \"Could not load random states\" and keeps that process's RNG")):
        more, out = _rng_plan(rng, world_size, name, single, missing)
        copies += more
        left += out
    if not accelerate and not (root / "trainer_state.json").is_file():
        left.append(LeftOut(None, FileRole.TRAINER_STATE, f"'{root}' has no trainer_state.json; "
                                                          "Trainer.train(resume_from_checkpoint=OUT) needs it"))
    client = "Accelerate" if accelerate and not is_hf_folder(root) else "Hugging Face Trainer"
    return HfFilesPlan(root, tuple(copies), tuple(left), client)


def _copy_regular(src: str | os.PathLike[str], dst: str | os.PathLike[str]) -> None:
    """Copy one file, refusing anything but a regular file (a FIFO blocks, ``/dev/zero`` never ends)."""
    regular_file(src)
    copy_file(src, dst, keep_times=False)


def _copy2_regular(src: str, dst: str) -> str:
    """:func:`shutil.copy2` (for ``copytree``: times kept), refusing anything but a regular file."""
    regular_file(src)
    return shutil.copy2(src, dst)


def copy_files(plan: HfFilesPlan, dest: Path) -> list[Path]:
    """Copy every file of ``plan`` into ``dest`` (a temporary folder that the caller moves into place)
    and check each copy's size. Returns the written paths."""
    written = []
    for c in plan.copies:
        target = dest / c.dest_name
        if c.source.is_dir():
            copy_tree(c.source, target, copy_function=_copy2_regular)
        elif c.json_updates:
            data = json.loads(read_small_file(c.source).decode("utf-8"))
            data.update(dict(c.json_updates))
            target.write_text(json.dumps(data, indent=2, sort_keys=True) + "\n", encoding="utf-8")
        else:
            _copy_regular(c.source, target)
            if target.stat().st_size != c.source.stat().st_size:
                raise CorruptCheckpointError(f"copying '{c.source}' to '{target}' wrote "
                                             f"{target.stat().st_size} of {c.source.stat().st_size} bytes; "
                                             "check the free space of the output's disk")
        written.append(target)
    return written
