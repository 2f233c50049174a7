"""The checkpoints of a run, whether each is completely written, and the scan record kept beside each.

A *run* is what a training job saves into over time: a DeepSpeed save dir (one tag folder per save), a Hugging
Face Trainer ``output_dir`` (one ``checkpoint-N/`` per save, each a save dir) or a Lightning ``dirpath`` (one
``*.ckpt`` per save; a folder holding a save dir under ``DeepSpeedStrategy``). :func:`list_run_checkpoints` names
its checkpoints in step order, each as a user would pass it to another command.

:func:`checkpoint_complete` tells whether a checkpoint's rank files are all written (what ``watch`` and the
callbacks wait for before scanning): DeepSpeed 0.19.8 writes ``latest`` after every rank has saved the tag
(engine.py ``save_checkpoint``: barrier, then ``_save_latest``).

The **scan record** (:func:`write_record`, :func:`load_valid_record`) is a small JSON file that ``watch`` and the
callbacks write beside each checkpoint after scanning it, and that ``scan --all`` reuses while the checkpoint's
files are unchanged. It lives in the folder holding the checkpoint's rank files (the tag folder:
``<save_dir>/<tag>/``, ``checkpoint-N/global_stepN/``, ``X.ckpt/checkpoint/``), so it moves, is copied and is
deleted with them (a Trainer's ``save_total_limit`` removing ``checkpoint-N`` removes its record). It holds a
*fingerprint* of every file of that folder (relative name, size, ``mtime_ns``; the record and its temporary files
left out): any file added, removed, rewritten or touched makes the record stale, and it is then ignored, never
trusted. Every other dsckpt command ignores the file (it is not a rank file: :func:`dsckpt.layout.classify_files`
leaves it among ``other_files``, which nothing reads or copies).

The library never writes a record on its own: ``scan`` (``--all`` included) only reads them.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import DsckptError

__all__ = [
    "RECORD_FORMAT",
    "RECORD_NAME",
    "RECORD_VERSION",
    "RunCheckpoint",
    "RunCheckpointKind",
    "checkpoint_complete",
    "completeness_problem",
    "fingerprint",
    "is_record_file",
    "list_run_checkpoints",
    "load_valid_record",
    "record_path",
    "tag_dir_of",
    "write_record",
]

logger = logging.getLogger(__name__)

RECORD_NAME = "dsckpt-scan.json"
RECORD_FORMAT = "dsckpt-scan-record"
RECORD_VERSION = 1
#: A record is at most this big (it holds one checkpoint's scan summary, findings capped by the writer).
MAX_RECORD_NBYTES = 4 << 20

_HF_CHECKPOINT = re.compile(r"^checkpoint-(\d+)$")
_GLOBAL_STEP = re.compile(r"^global_step(\d+)$")
# Lightning's ModelCheckpoint default filename "{epoch}-{step}" gives "epoch=0-step=3.ckpt".
_LIGHTNING_STEP = re.compile(r"(?:^|[-_])step=(\d+)")
_LIGHTNING_LAST = "last.ckpt"


class RunCheckpointKind(enum.Enum):
    DEEPSPEED_TAG = "deepspeed tag"  # <save_dir>/<tag>
    HF_CHECKPOINT = "trainer checkpoint"  # <output_dir>/checkpoint-N (a save dir)
    LIGHTNING_CKPT = "lightning checkpoint"  # <dirpath>/*.ckpt (a save dir under DeepSpeedStrategy, or a file)


@dataclass(frozen=True)
class RunCheckpoint:
    """One checkpoint of a run. ``path`` is what a user passes to another command (``dsckpt scan PATH``);
    ``step`` comes from its name (``global_stepN``, ``checkpoint-N``, ``step=N``), None when the name holds none
    (the checkpoint's own ``global_steps`` is read when it is opened)."""

    path: Path
    step: int | None
    kind: RunCheckpointKind

    def to_dict(self) -> dict[str, Any]:
        return {"path": str(self.path), "step": self.step, "kind": self.kind.value}


def _natural_key(s: str) -> list[Any]:
    return [(0, int(t)) if t.isdigit() else (1, t) for t in re.split(r"(\d+)", s)]


def _order(c: RunCheckpoint) -> tuple[Any, ...]:
    # named steps first in step order; then the rest (custom tags, last.ckpt) by name
    return (c.step is None, c.step if c.step is not None else 0, _natural_key(c.path.name))


def list_run_checkpoints(run_path: str | os.PathLike[str]) -> list[RunCheckpoint]:
    """Every checkpoint of the run at ``run_path``, in step order (see the module docstring).

    ``run_path`` may be a DeepSpeed save dir (every tag folder), a Trainer ``output_dir`` (every ``checkpoint-N``),
    a Lightning ``dirpath`` (every ``*.ckpt``), or a single checkpoint (a tag folder, or a save dir with one tag):
    a list of one. A folder holding several kinds lists them all (``scan --all`` then says which belong to another
    run). Empty when nothing there looks like a checkpoint. Reads directory entries only."""
    from .layout import _is_tag_dir, list_tags

    p = Path(run_path)
    if not p.is_dir():
        if p.suffix == ".ckpt" and p.is_file():
            return [RunCheckpoint(p, _lightning_step(p.name), RunCheckpointKind.LIGHTNING_CKPT)]
        return []
    if _is_tag_dir(p):
        m = _GLOBAL_STEP.match(p.name)
        return [RunCheckpoint(p, int(m[1]) if m else None, RunCheckpointKind.DEEPSPEED_TAG)]
    found: list[RunCheckpoint] = []
    for tag in list_tags(p):
        m = _GLOBAL_STEP.match(tag)
        found.append(RunCheckpoint(p / tag, int(m[1]) if m else None, RunCheckpointKind.DEEPSPEED_TAG))
    try:
        entries = sorted(os.scandir(p), key=lambda e: e.name)
    except OSError:
        entries = []
    for e in entries:
        if m := _HF_CHECKPOINT.match(e.name):
            if e.is_dir():
                found.append(RunCheckpoint(p / e.name, int(m[1]), RunCheckpointKind.HF_CHECKPOINT))
        elif e.name.endswith(".ckpt") and (e.is_dir() or e.is_file()):
            found.append(RunCheckpoint(p / e.name, _lightning_step(e.name), RunCheckpointKind.LIGHTNING_CKPT))
    return sorted(found, key=_order)


def _lightning_step(name: str) -> int | None:
    m = _LIGHTNING_STEP.search(name)
    return int(m[1]) if m else None


def tag_dir_of(ckpt_path: str | os.PathLike[str]) -> Path:
    """The folder holding the rank files of the checkpoint at ``ckpt_path`` (a tag folder, a save dir with
    ``latest``, a Trainer ``checkpoint-N``, a Lightning ``X.ckpt`` folder). A file (a Lightning ``.ckpt`` written
    without DeepSpeed) is its own checkpoint: the file itself is returned. Raises :class:`DsckptError` when
    ``ckpt_path`` is no checkpoint."""
    from .layout import find_tag_dir

    p = Path(ckpt_path)
    if p.is_file():
        return p
    return find_tag_dir(p)[2]


def record_path(ckpt_path: str | os.PathLike[str]) -> Path:
    """Where the scan record of the checkpoint at ``ckpt_path`` goes: ``<tag folder>/dsckpt-scan.json``
    (``X.ckpt.dsckpt-scan.json`` beside a Lightning ``.ckpt`` file)."""
    where = tag_dir_of(ckpt_path)
    if where.is_file():
        return where.with_name(f"{where.name}.{RECORD_NAME}")
    return where / RECORD_NAME


def is_record_file(name: str) -> bool:
    """A scan record or one of its temporary files (``.dsckpt-scan.json.<pid>@host....tmp``). Pure."""
    return name == RECORD_NAME or name.endswith("." + RECORD_NAME) or (
        name.startswith(f".{RECORD_NAME}.") and name.endswith(".tmp"))


def fingerprint(ckpt_path: str | os.PathLike[str]) -> dict[str, Any]:
    """``{"files": [[relative name, size in bytes, mtime_ns], ...]}`` for every file of the checkpoint at
    ``ckpt_path`` (every file under its tag folder, sub-folders included, sorted by name; the record and its
    temporary files left out). Symlinks are followed (their target's size and time)."""
    where = tag_dir_of(ckpt_path)
    if where.is_file():
        st = where.stat()
        return {"files": [[where.name, st.st_size, st.st_mtime_ns]]}
    files: list[tuple[str, int, int]] = []
    for dirpath, dirnames, filenames in os.walk(where):
        dirnames.sort()
        for name in sorted(filenames):
            if is_record_file(name):
                continue
            full = Path(dirpath) / name
            st = full.stat()
            files.append((full.relative_to(where).as_posix(), st.st_size, st.st_mtime_ns))
    files.sort()
    return {"files": [list(f) for f in files]}


def write_record(ckpt_path: str | os.PathLike[str], result: dict[str, Any]) -> Path:
    """Write ``result`` (JSON-serialisable: one checkpoint's entry of ``scan --all --json``) as the scan record of
    the checkpoint at ``ckpt_path``, with the fingerprint of its files taken *before* writing; atomically (a
    reader sees the old record, or the new one, never part of one). Returns the record's path.

    Take the fingerprint you trust: a caller that scanned the files should compare :func:`fingerprint` from
    before its scan with the one after (``write_record`` stamps the files as they are now)."""
    from . import __version__
    from .atomic import atomic_file

    target = record_path(ckpt_path)
    record = {"format": RECORD_FORMAT, "version": RECORD_VERSION, "dsckpt": __version__,
              "fingerprint": fingerprint(ckpt_path), "result": result}
    data = json.dumps(record, indent=1, sort_keys=True).encode("utf-8")
    with atomic_file(target, make_parent=False) as f:
        f.write(data)
    return target


def load_valid_record(ckpt_path: str | os.PathLike[str]) -> dict[str, Any] | None:
    """The ``result`` of the checkpoint's scan record, or None when there is none, it cannot be read (not JSON, not
    this format or version, too big), or the checkpoint's files changed since it was written (the fingerprint
    differs). Never raises for a bad record: a record is a cache, and a bad one means 'scan again'."""
    try:
        target = record_path(ckpt_path)
        with open(target, "rb") as f:
            data = f.read(MAX_RECORD_NBYTES + 1)
        if len(data) > MAX_RECORD_NBYTES:
            logger.info("%s: larger than %d bytes; ignored", target, MAX_RECORD_NBYTES)
            return None
        record = json.loads(data.decode("utf-8"))
        if not (isinstance(record, dict) and record.get("format") == RECORD_FORMAT
                and record.get("version") == RECORD_VERSION and isinstance(record.get("result"), dict)):
            logger.info("%s: not a version-%d scan record; ignored", target, RECORD_VERSION)
            return None
        if record.get("fingerprint") != fingerprint(ckpt_path):
            logger.info("%s: the checkpoint's files changed since it was written; ignored", target)
            return None
        result: dict[str, Any] = record["result"]
        return result
    except (OSError, ValueError, DsckptError):
        return None


def completeness_problem(ckpt_path: str | os.PathLike[str], *, require_latest: bool = True) -> str | None:
    """Why the checkpoint at ``ckpt_path`` is not completely written yet, or None when it is. Reads directory
    entries, ``latest`` and the rank-0 model-states file's pickle metadata (for the world sizes); no tensor data.

    A DeepSpeed tag is complete when
    * its save dir holds ``latest`` (DeepSpeed 0.19.8 writes it after every rank saved: engine.py
      ``save_checkpoint``, ``dist.barrier()`` then ``_save_latest``), and either ``latest`` names this tag, or this
      tag is an older save than the one ``latest`` names (by ``global_stepN`` name), or ``latest`` was written
      after every file of this tag (mtime);
    * every rank's files are there: model-states and optimizer files for every data-parallel rank up to the
      model-states' ``dp_world_size`` and every model-parallel rank (as the readers check).
    A Trainer ``checkpoint-N`` also needs its ``trainer_state.json`` (the Trainer writes it after DeepSpeed's files).
    A Lightning ``.ckpt`` file (no DeepSpeed) is complete when it is a readable zip or pickle file: not checked
    here. ``require_latest=False``: a save dir holding no ``latest`` at all is not a problem by itself (a run saved
    with ``save_latest=False``); the rank files are still checked."""
    from .layout import classify_files, expect_dp_ranks, find_tag_dir

    p = Path(ckpt_path)
    if p.is_file():
        return None
    try:
        root, tag, tag_dir = find_tag_dir(p)
    except DsckptError as e:
        return str(e)
    if _HF_CHECKPOINT.match(root.name) and not (root / "trainer_state.json").is_file():
        return f"'{root}' has no trainer_state.json yet: the Trainer has not finished this save"
    latest = root / "latest"
    has_latest = latest.is_file()
    if not has_latest and require_latest:
        return (f"'{root}' holds no 'latest' file: DeepSpeed writes it once every rank has saved, so this save "
                "was not finished (or the run saves with save_latest=False)")
    try:
        named = latest.read_text("utf-8", errors="replace").strip() if has_latest else tag
        files = classify_files(root, tag, tag_dir)
        newest = max((f.stat().st_mtime_ns for f in files.all_files()), default=0)
        latest_ns = latest.stat().st_mtime_ns if has_latest else newest
    except (OSError, DsckptError) as e:
        return str(e)
    if named != tag:
        mine, theirs = _GLOBAL_STEP.match(tag), _GLOBAL_STEP.match(named)
        older = bool(mine and theirs and int(mine[1]) < int(theirs[1]))
        if not older and newest > latest_ns:
            return (f"'{latest}' names '{named}' and was written before this tag's files: this save of "
                    f"'{tag}' was not finished (interrupted, or still being written)")
    try:
        problem = _missing_ranks(files, expect_dp_ranks)
    except (OSError, DsckptError) as e:
        return str(e)
    return problem


def _missing_ranks(files: Any, expect_dp_ranks: Any) -> str | None:
    from .readers.common import FileCache

    ms = files.mp_to_model_states.get(0) or files.dp_mp_to_zero3_model_states.get((0, 0))
    if ms is None:
        return None  # pipeline / universal layouts: the reader checks their files when opened
    tree = FileCache().tree(ms)
    dp = tree.get("dp_world_size") if isinstance(tree, dict) else None
    if not isinstance(dp, int) or isinstance(dp, bool) or dp < 1:
        return None
    try:
        if files.dp_mp_to_zero3_model_states:
            expect_dp_ranks(files, "ZeRO-3 model-states", files.dp_mp_to_zero3_model_states, dp)
        if files.dp_mp_to_optim_states:
            expect_dp_ranks(files, "optimizer-state", files.dp_mp_to_optim_states, dp)
    except DsckptError as e:
        return str(e)
    return None


def checkpoint_complete(path: str | os.PathLike[str]) -> bool:
    """True when every rank file of the checkpoint at ``path`` is written (:func:`completeness_problem`)."""
    return completeness_problem(path) is None
