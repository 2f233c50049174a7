"""The scanner process of :class:`dsckpt.watch.BackgroundScanner`: ``python -m dsckpt.scan_worker``.

Reads one JSON request per line on stdin (``{"path", "nonfinite_only", "workers", "complete_timeout_s",
"finished_save"}``), waits until that checkpoint is completely written
(:func:`dsckpt.scan_record.completeness_problem`; at most ``complete_timeout_s`` seconds, then it is answered as
unreadable; ``finished_save``: the caller saw the save end, so a folder with no DeepSpeed layout at all, a Trainer
save without DeepSpeed say, is answered at once rather than waited for), scans it, writes
its scan record beside it (:func:`dsckpt.scan_record.write_record`; a valid record already there is reused, not
rescanned) and answers one JSON line on stdout (:func:`handle`). Ends when stdin closes. Never raises for a bad
checkpoint: a damaged, half-written, deleted or rewritten one is an ``unreadable`` answer naming why, and the next
request is served.

What is checked and recorded is what ``scan RUN --all`` checks for each checkpoint
(:func:`dsckpt.scan_run.check_checkpoint`), so a record written here is reused there and the other way round.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .scan_record import RunCheckpoint

__all__ = ["handle", "main", "run_checkpoint"]

logger = logging.getLogger(__name__)

COMPLETE_POLL_S = 0.2


def run_checkpoint(path: Path) -> RunCheckpoint:
    """``path`` as an entry of its run's listing (its step and kind), or as a run of its own."""
    from .scan_record import RunCheckpoint, RunCheckpointKind, list_run_checkpoints

    listed = next((c for c in list_run_checkpoints(path.parent) if c.path == path), None)
    if listed is None:
        listed = next(iter(list_run_checkpoints(path)), None)
    if listed is None:
        kind = RunCheckpointKind.LIGHTNING_CKPT if path.suffix == ".ckpt" else RunCheckpointKind.DEEPSPEED_TAG
        listed = RunCheckpoint(path, None, kind)
    return listed


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one request: ``{"status": "clean"|"findings"|"unreadable", "findings": [line, ...], "count",
    "message", "reused", "step"}``. The checkpoint is checked as ``scan --all`` checks each one
    (:func:`dsckpt.scan_run.check_checkpoint`, which reuses a valid record); a new clean or findings result is
    written as its scan record (``entry.to_dict()``). Incomplete, unreadable or changed-while-read checkpoints get no
    record (the next look reads them again)."""
    from .scan_record import completeness_problem, write_record
    from .scan_run import RunStatus, check_checkpoint

    path = Path(request["path"])
    try:
        end = time.monotonic() + float(request.get("complete_timeout_s", 0.0))
        while (problem := completeness_problem(path)) is not None:
            if not os.path.lexists(path):
                return _unreadable("deleted before it was complete")
            if request.get("finished_save") and not _has_deepspeed_layout(path):
                break  # a finished save without DeepSpeed's layout: check_checkpoint names it, no use waiting
            if time.monotonic() >= end:
                return _unreadable(f"not completely written after {request.get('complete_timeout_s', 0)} s: "
                                   f"{problem}")
            time.sleep(COMPLETE_POLL_S)
        entry = check_checkpoint(run_checkpoint(path), nonfinite_only=bool(request.get("nonfinite_only")),
                                 workers=int(request.get("workers") or 0))
        if entry.status in (RunStatus.CLEAN, RunStatus.FINDINGS):
            if not entry.reused_record:
                write_record(path, entry.to_dict())
            return {"status": entry.status.value, "findings": list(entry.details), "count": entry.findings,
                    "message": None, "reused": entry.reused_record, "step": entry.step}
        return _unreadable(entry.summary)
    except Exception as e:
        logger.exception("dsckpt scanner: error on %s", path)
        return _unreadable(f"{type(e).__name__}: {e}".replace("\n", " "))


def _has_deepspeed_layout(path: Path) -> bool:
    from .errors import DsckptError
    from .scan_record import tag_dir_of

    try:
        tag_dir_of(path)
    except (DsckptError, OSError):
        return False
    return True


def _unreadable(message: str) -> dict[str, Any]:
    return {"status": "unreadable", "findings": [], "count": 1, "message": message, "reused": False}


def main() -> int:
    from .watch import WORKER_NICE

    logging.basicConfig(level=logging.WARNING, format="dsckpt scanner: %(message)s")
    try:
        os.nice(WORKER_NICE)  # yield the CPU to the training ranks
    except OSError:
        pass
    for line in sys.stdin:
        if not line.strip():
            continue
        answer = handle(json.loads(line))
        sys.stdout.write(json.dumps(answer) + "\n")
        sys.stdout.flush()
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
