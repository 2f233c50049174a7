"""Find the tag folder of a DeepSpeed checkpoint and name its files. No torch, no unpickling.

A user may point at the save dir (``<save_dir>/latest`` names the tag), at a tag folder, at a
Hugging Face Trainer ``checkpoint-N/`` folder (which is a save dir), or at the *run folder* holding
several checkpoints (:func:`resolve_run_folder`: a Trainer ``output_dir`` or a Lightning ``dirpath``). Tags are
free-form: Accelerate saves under ``pytorch_model``, not ``global_stepN`` (DEEPSPEED-NOTES 1.1). A DeepSpeed *universal*
checkpoint folder (``ds_to_universal``) is a tag folder too: its copied model-states files sit beside
``zero/``, and ``latest_universal`` in its parent names it (ds_to_universal.py:1370-1374). ``latest``
wins where a save dir has both (ds_to_universal writes ``latest_universal`` into the original save dir).
"""

from __future__ import annotations

import enum
import logging
import os
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

from .errors import (
    CheckpointNotFoundError,
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
    UsageError,
    shorten,
)
from .limits import read_small_file

__all__ = [
    "CONFIG_KEYS",
    "DEEPSPEED_MODEL_STATES_KEYS",
    "OSD",
    "UNIVERSAL_DIR",
    "CheckpointFiles",
    "Owner",
    "RunFolderChoice",
    "RunFolderKind",
    "choose_in_run_folder",
    "classify_files",
    "find_tag_dir",
    "is_rank_file_name",
    "is_universal_dir",
    "key_owner",
    "list_tags",
    "partition_set",
    "resolve_run_folder",
]

OSD = "optimizer_state_dict"  # the optimizer files' top-level key (and ZeRO-3's inner one)
UNIVERSAL_DIR = "zero"  # ds_to_universal.py: <tag>/zero/<param name>/{fp32,exp_avg,exp_avg_sq,step}.pt
UNIVERSAL_OPTIMIZER_STATE = "optimizer_state.pt"

# DeepSpeed 0.19.8 engine.py:4319-4381, pipe/module.py:588-605.
_MODEL_STATES = re.compile(r"^mp_rank_(\d+)_model_states\.pt$")
_ZERO3_MODEL_STATES = re.compile(r"^zero_pp_rank_(\d+)_mp_rank_(\d+)_model_states\.pt$")
# Very old releases wrote "...mp_rank_00optim_states.pt" (no underscore); the loader still accepts it.
_OPTIM_STATES = re.compile(r"^(bf16_)?zero_pp_rank_(\d+)_mp_rank_(\d+)_?optim_states\.pt$")
_LAYER = re.compile(r"^layer_(\d+)(?:-model_(\d+))?-model_states\.pt$")
# MoE (engine.py:4362-4381): one file per MoE layer and *global* expert id, written by expert-data-
# parallel rank 0 of each expert-parallel group; per expert-parallel rank optimizer files without ZeRO.
_EXPERT = re.compile(r"^layer_(\d+)_expert_(\d+)_mp_rank_(\d+)_model_states\.pt$")
_LEGACY_EXPERT = re.compile(r"^expert_\d+_mp_rank_\d+_model_states\.pt$")
_EXPP_OPTIM = re.compile(r"^expp_rank_(\d+)_mp_rank_(\d+)_optim_states\.pt$")

logger = logging.getLogger(__name__)

# transformers.trainer_utils (5.23): PREFIX_CHECKPOINT_DIR = "checkpoint", _re_checkpoint = ^checkpoint\-(\d+)$;
# get_last_checkpoint() takes the directory with the largest N.
_HF_CHECKPOINT = re.compile(r"^checkpoint\-(\d+)$")
# Lightning's ModelCheckpoint(save_last=True) names its copy "last.ckpt" (CHECKPOINT_NAME_LAST); with
# DeepSpeedStrategy every "*.ckpt" is a folder (a DeepSpeed save dir with tag "checkpoint").
_LIGHTNING_LAST = "last.ckpt"

# The top-level keys of a model-states file that hold the model, the optimizer or DeepSpeed's own
# bookkeeping: ``_common_checkpoint_state`` and ``_save_checkpoint`` (engine.py:5017-5038, 5383-5400 in
# 0.19.8; DEEPSPEED-NOTES 1.3). Older releases write a subset. Left out on purpose, although DeepSpeed
# writes them: ``lr_scheduler``, ``data_sampler`` and ``random_ltd`` — a scheduler's or sampler's state
# (a ReduceLROnPlateau ``best`` is inf until its first step), not model data.
DEEPSPEED_MODEL_STATES_KEYS = frozenset({
    "module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "frozen_param_fragments",
    "shared_params", "sparse_tensor_module_names", "skipped_steps", "global_steps", "global_samples",
    "dp_world_size", "mp_world_size", "checkpoint_parallel_dimensions", "ds_config", "ds_version",
    "num_experts", "ds_autoep_layers", "universal_checkpoint_info", "folding",
})


@dataclass(frozen=True)
class CheckpointFiles:
    """The files of one tag folder, by role. Paths are absolute; ranks index the mappings."""

    root: Path
    tag: str
    tag_dir: Path
    mp_to_model_states: dict[int, Path]
    dp_mp_to_zero3_model_states: dict[tuple[int, int], Path]
    dp_mp_to_optim_states: dict[tuple[int, int], Path]
    bf16_prefixed_optim: bool
    layer_files: dict[tuple[int, int | None], Path]
    other_files: tuple[Path, ...]
    # MoE: (moe layer, global expert id, mp rank) -> file; (expert-parallel rank, mp rank) -> file
    layer_expert_to_files: dict[tuple[int, int, int], Path] = field(default_factory=dict)
    ep_mp_to_expp_optim_states: dict[tuple[int, int], Path] = field(default_factory=dict)

    @property
    def mp_world_size(self) -> int:
        mps = set(self.mp_to_model_states) | {mp for _, mp in self.dp_mp_to_zero3_model_states}
        mps |= {mp for _, mp in self.dp_mp_to_optim_states}
        return max(mps) + 1 if mps else 1

    @property
    def optim_dp_world_size(self) -> int:
        return max((dp for dp, _ in self.dp_mp_to_optim_states), default=-1) + 1

    def all_files(self) -> list[Path]:
        files = [*self.mp_to_model_states.values(), *self.dp_mp_to_zero3_model_states.values(),
                 *self.dp_mp_to_optim_states.values(), *self.layer_files.values(),
                 *self.layer_expert_to_files.values(), *self.ep_mp_to_expp_optim_states.values()]
        return sorted(files)


def is_universal_dir(tag_dir: Path) -> bool:
    """A DeepSpeed universal checkpoint folder: ``zero/optimizer_state.pt`` beside model-states files."""
    return (tag_dir / UNIVERSAL_DIR / UNIVERSAL_OPTIMIZER_STATE).is_file()


class Owner(enum.Enum):
    """Whose value a key path of a DeepSpeed file holds (see :func:`key_owner`)."""

    MODEL = "model"  # model or optimizer data, or DeepSpeed's own bookkeeping: a non-finite value is a finding
    CLIENT_STATE = "client state"  # kept by the trainer for itself: shown apart, never a finding
    CONFIG = "config"  # the run's configuration as the user wrote it: not checked


# Configuration, not data, in every file DeepSpeed writes: the HF Trainer passes ``steps_per_print: inf``.
CONFIG_KEYS = frozenset({"ds_config", "ds_version"})


def key_owner(file_name: str, key: tuple[object, ...]) -> Owner:
    """Who owns the value at ``key`` (a key path from the file's top level) in the file ``file_name``.

    The rule, in order: a first key in :data:`CONFIG_KEYS` is configuration. In a file that DeepSpeed
    merges ``client_state`` into — ``mp_rank_XX_model_states.pt`` or, at stage 3,
    ``zero_pp_rank_D_mp_rank_XX_model_states.pt`` (engine.py:5400) — a first key that is not in
    :data:`DEEPSPEED_MODEL_STATES_KEYS` is client state: Lightning's ``callbacks``/``loops``/
    ``lr_schedulers``, anything passed as ``save_checkpoint(client_state=...)``, and DeepSpeed's own
    ``lr_scheduler``/``data_sampler``/``random_ltd``. Everything else is the model's: optimizer,
    pipeline-layer, expert and universal files never hold client state. Pure: no I/O."""
    if key and isinstance(key[0], str) and key[0] in CONFIG_KEYS:
        return Owner.CONFIG
    if not key or not (_MODEL_STATES.match(file_name) or _ZERO3_MODEL_STATES.match(file_name)):
        return Owner.MODEL
    if isinstance(key[0], str) and key[0] in DEEPSPEED_MODEL_STATES_KEYS:
        return Owner.MODEL
    return Owner.CLIENT_STATE


class RunFolderKind(enum.Enum):
    HF_OUTPUT_DIR = "Hugging Face Trainer output_dir"
    LIGHTNING_DIRPATH = "Lightning ModelCheckpoint dirpath"


@dataclass(frozen=True)
class RunFolderChoice:
    """The checkpoint picked inside a run folder, and why."""

    folder: Path
    checkpoint: Path
    kind: RunFolderKind
    rule: str
    candidates: tuple[str, ...]

    def describe(self) -> str:
        return f"using {self.checkpoint} ({self.rule} in {self.kind.value} '{self.folder}')"

    def to_dict(self) -> dict[str, object]:
        return {"folder": str(self.folder), "checkpoint": str(self.checkpoint), "kind": self.kind.value,
                "rule": self.rule, "candidates": list(self.candidates)}


def choose_in_run_folder(folder: Path, dir_names: Iterable[str]) -> RunFolderChoice | None:
    """Which checkpoint a run folder means, from the names of its sub-directories. Pure: no I/O.

    * ``checkpoint-N`` directories (a Hugging Face Trainer ``output_dir``): the largest N, compared as
      numbers (``checkpoint-10`` after ``checkpoint-9``), as ``transformers.trainer_utils.get_last_checkpoint``;
    * ``*.ckpt`` directories (a Lightning ``dirpath`` with ``DeepSpeedStrategy``): ``last.ckpt`` if
      present, else the only one; several and no ``last.ckpt`` is a :class:`UsageError` listing them.

    None when neither kind is there (then ``folder`` is not a run folder)."""
    names = sorted(set(dir_names))
    numbered = [(int(m[1]), n) for n in names if (m := _HF_CHECKPOINT.match(n))]
    if numbered:
        step, name = max(numbered)
        return RunFolderChoice(folder, folder / name, RunFolderKind.HF_OUTPUT_DIR,
                               f"the newest checkpoint-N, N={step}", tuple(n for _, n in sorted(numbered)))
    ckpts = [n for n in names if n.endswith(".ckpt")]
    if not ckpts:
        return None
    if _LIGHTNING_LAST in ckpts:
        return RunFolderChoice(folder, folder / _LIGHTNING_LAST, RunFolderKind.LIGHTNING_DIRPATH,
                               _LIGHTNING_LAST, tuple(ckpts))
    if len(ckpts) == 1:
        return RunFolderChoice(folder, folder / ckpts[0], RunFolderKind.LIGHTNING_DIRPATH,
                               "the only *.ckpt checkpoint", tuple(ckpts))
    raise UsageError(
        f"'{folder}' holds {len(ckpts)} Lightning checkpoints and no {_LIGHTNING_LAST}: {', '.join(ckpts)}; "
        "point dsckpt at one of them")


def resolve_run_folder(path: str | os.PathLike[str]) -> RunFolderChoice | None:
    """The checkpoint to use when ``path`` is a run folder (see :func:`choose_in_run_folder`); None when
    ``path`` is a DeepSpeed checkpoint itself (it holds ``latest``, is a tag folder or holds one), is not
    a directory, or holds no run-folder checkpoints."""
    p = Path(path)
    if not p.is_dir() or (p / "latest").is_file() or (p / "latest_universal").is_file() or _is_tag_dir(p) \
            or list_tags(p):
        return None
    try:
        dirs = [e.name for e in os.scandir(p) if e.is_dir()]
    except OSError:
        return None
    return choose_in_run_folder(p, dirs)


def _is_tag_dir(path: Path) -> bool:
    try:
        return any(
            _MODEL_STATES.match(n) or _ZERO3_MODEL_STATES.match(n) or _LAYER.match(n)
            for n in os.listdir(path)
        ) or is_universal_dir(path)
    except (NotADirectoryError, FileNotFoundError, PermissionError):
        return False


def list_tags(root: str | os.PathLike[str]) -> list[str]:
    """Sub-folders of ``root`` that hold DeepSpeed model-states files, sorted naturally."""
    root = Path(root)
    try:
        names = [n for n in os.listdir(root) if (root / n).is_dir() and _is_tag_dir(root / n)]
    except (NotADirectoryError, FileNotFoundError):
        return []
    return sorted(names, key=_natural_key)


def _natural_key(s: str) -> list[object]:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", s)]


def _plain_tag(name: str) -> bool:
    """A tag DeepSpeed could have written: a non-empty relative path inside the save dir, each part a possible
    file name (at most 255 bytes: NAME_MAX on Linux and macOS)."""
    parts = Path(name).parts
    return bool(name) and "\x00" not in name and not Path(name).is_absolute() and ".." not in parts and \
        all(len(part.encode("utf-8", "surrogateescape")) <= 255 for part in parts)


def find_tag_dir(path: str | os.PathLike[str], tag: str | None = None) -> tuple[Path, str, Path]:
    """Resolve ``path`` (save dir or tag folder) and ``tag`` to ``(root, tag, tag_dir)``."""
    p = Path(path)
    if not p.exists():
        raise CheckpointNotFoundError(f"'{p}' does not exist")
    if p.is_file():
        raise CheckpointNotFoundError(
            f"'{p}' is a file; point dsckpt at the checkpoint folder (the one holding 'latest') "
            "or at a tag folder such as 'global_step100'"
        )
    run = resolve_run_folder(p)
    if run is not None:
        logger.info("%s", run.describe())
        p = run.checkpoint
    if tag is None and _is_tag_dir(p):
        return p.parent, p.name, p
    if tag is not None:
        if not _plain_tag(tag):
            raise UsageError(f"--tag '{tag!r}' is not a tag folder name")
        candidate = p / tag
        if _is_tag_dir(candidate):
            return p, tag, candidate
        if p.name == tag and _is_tag_dir(p):
            return p.parent, tag, p
        raise CheckpointNotFoundError(
            f"tag '{tag}' not found in '{p}'; available tags: {', '.join(list_tags(p)) or 'none'}"
        )
    latest = p / "latest"
    tags = list_tags(p)
    if not latest.is_file() and (p / "latest_universal").is_file():
        latest = p / "latest_universal"
    if os.path.lexists(latest) and not latest.is_file():
        read_small_file(latest)  # a FIFO, device, folder or dangling link named 'latest': refused, naming it
    if latest.is_file():
        content = read_small_file(latest)
        try:
            name = content.decode("utf-8").strip()
        except UnicodeDecodeError:
            name = ""
        if not _plain_tag(name):
            raise CorruptCheckpointError(
                f"'{latest}' does not hold a tag folder name ({shorten(content, 60)}); it is corrupt. "
                f"Available tags: {', '.join(tags) or 'none'}; pick one with --tag")
        if _is_tag_dir(p / name):
            return p, name, p / name
        raise CheckpointNotFoundError(
            f"'{latest}' names tag '{shorten(name)}', but that folder holds no DeepSpeed model-states files; "
            f"available tags: {', '.join(tags) or 'none'}. Pick one with --tag"
        )
    if len(tags) == 1:
        return p, tags[0], p / tags[0]
    if tags:
        raise CheckpointNotFoundError(
            f"'{p}' has no 'latest' file and several tags ({', '.join(tags)}); pick one with --tag"
        )
    raise CheckpointNotFoundError(
        f"'{p}' is not a DeepSpeed checkpoint: no 'latest' file, no tag folder and no "
        "*model_states.pt files found"
    )


def is_rank_file_name(name: str) -> bool:
    """A file name DeepSpeed gives one rank's (or one layer's, one expert's) file. Pure."""
    return any(r.match(name) for r in (_MODEL_STATES, _ZERO3_MODEL_STATES, _OPTIM_STATES, _LAYER, _EXPERT,
                                       _LEGACY_EXPERT, _EXPP_OPTIM))


def partition_set(name: str) -> tuple[bool, int] | None:
    """For a ZeRO optimizer file, the set of files whose members each hold a different data-parallel partition of
    one flat optimizer state (``(bf16 prefix, mp rank)``): two members of one save never hold the same bytes. None
    for other files: ZeRO-3 model-states files hold only placeholders, shapes and buffers (two ranks' may be
    identical, as Lightning's are), and the optimizer files of two TP ranks may be identical (params replicated
    on both). Pure."""
    m = _OPTIM_STATES.match(name)
    return (bool(m[1]), int(m[3])) if m else None


def classify_files(root: Path, tag: str, tag_dir: Path) -> CheckpointFiles:
    """Name every file of the tag folder; refuse layouts that are recognised but unsupported."""
    model_states: dict[int, Path] = {}
    zero3: dict[tuple[int, int], Path] = {}
    optim: dict[tuple[int, int], Path] = {}
    layers: dict[tuple[int, int | None], Path] = {}
    others: list[Path] = []
    prefixes: set[bool] = set()
    experts: dict[tuple[int, int, int], Path] = {}
    expp: dict[tuple[int, int], Path] = {}
    legacy_moe: list[str] = []
    for name in sorted(os.listdir(tag_dir)):
        full = tag_dir / name
        if name == UNIVERSAL_DIR and full.is_dir():
            continue  # a universal checkpoint's per-param folders (readers/universal.py)
        if m := _MODEL_STATES.match(name):
            model_states[int(m[1])] = full
        elif m := _ZERO3_MODEL_STATES.match(name):
            zero3[(int(m[1]), int(m[2]))] = full
        elif m := _OPTIM_STATES.match(name):
            optim[(int(m[2]), int(m[3]))] = full
            prefixes.add(bool(m[1]))
        elif m := _LAYER.match(name):
            layers[(int(m[1]), int(m[2]) if m[2] is not None else None)] = full
        elif m := _EXPERT.match(name):
            experts[(int(m[1]), int(m[2]), int(m[3]))] = full
        elif m := _EXPP_OPTIM.match(name):
            expp[(int(m[1]), int(m[2]))] = full
        elif _LEGACY_EXPERT.match(name):
            legacy_moe.append(name)
        else:
            others.append(full)
    if legacy_moe:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' holds legacy Mixture-of-Experts files without a layer id (found {legacy_moe[0]}; "
            "the old naming that DeepSpeed 0.19.8 only loads as 'old_moe_load'), which is not supported; only "
            "'layer_{L}_expert_{E}_mp_rank_{MM}_model_states.pt' files can be read"
        )
    if len(prefixes) > 1:
        raise UnsupportedCheckpointError(
            f"'{tag_dir}' mixes 'bf16_zero_pp_rank_*' and 'zero_pp_rank_*' optimizer files; "
            "remove the stale set (they come from two different runs)"
        )
    _check_rank_sets(tag_dir, "optimizer-state", optim)
    _check_rank_sets(tag_dir, "ZeRO-3 model-state", zero3)
    return CheckpointFiles(
        root=root, tag=tag, tag_dir=tag_dir, mp_to_model_states=model_states,
        dp_mp_to_zero3_model_states=zero3, dp_mp_to_optim_states=optim,
        bf16_prefixed_optim=bool(prefixes and prefixes.pop()), layer_files=layers,
        other_files=tuple(others), layer_expert_to_files=experts, ep_mp_to_expp_optim_states=expp,
    )


def _check_rank_sets(tag_dir: Path, what: str, files: dict[tuple[int, int], Path]) -> None:
    """Every (dp, mp) rank from 0 to the highest seen must have a file; list all that are missing."""
    if not files:
        return
    dps = max(dp for dp, _ in files) + 1
    mps = max(mp for _, mp in files) + 1
    missing = [(dp, mp) for mp in range(mps) for dp in range(dps) if (dp, mp) not in files]
    if missing:
        shown = ", ".join(f"dp rank {dp}" + (f" / mp rank {mp}" if mps > 1 else "") for dp, mp in missing)
        raise IncompleteCheckpointError(
            f"{what} files missing in '{tag_dir}': {shown} (found {len(files)} of {dps * mps}). "
            "The save was probably interrupted; pick another tag with --tag"
        )


def expect_dp_ranks(files: CheckpointFiles, what: str, present: dict[tuple[int, int], Path],
                    dp_world_size: int) -> None:
    """Raise if ``present`` lacks any dp rank below the recorded ``dp_world_size`` (all listed)."""
    mps = files.mp_world_size
    missing = [(dp, mp) for mp in range(mps) for dp in range(dp_world_size) if (dp, mp) not in present]
    if missing:
        shown = ", ".join(f"rank {dp}" + (f" (mp {mp})" if mps > 1 else "") for dp, mp in missing)
        raise IncompleteCheckpointError(
            f"Expected {dp_world_size * mps} {what} files in '{files.tag_dir}' (dp_world_size="
            f"{dp_world_size}), missing {shown}. The save was probably interrupted; pick another tag "
            "with --tag"
        )
