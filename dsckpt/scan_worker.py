"""The scanner process of :class:`dsckpt.watch.BackgroundScanner`: ``python -m dsckpt.scan_worker``.

Reads one JSON request per line on stdin (``{"path", "nonfinite_only", "workers", "complete_timeout_s"}``), waits
until that checkpoint is completely written (:func:`dsckpt.scan_record.completeness_problem`; at most
``complete_timeout_s`` seconds, then it is answered as unreadable), scans it, writes
its scan record beside it (:func:`dsckpt.scan_record.write_record`; a valid record already there is reused, not
rescanned) and answers one JSON line on stdout (:func:`handle`). Ends when stdin closes. Never raises for a bad
checkpoint: a damaged, half-written, deleted or rewritten one is an ``unreadable`` answer naming why, and the next
request is served.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import time
from pathlib import Path
from typing import Any

__all__ = ["handle", "main", "scan_for_record"]

logger = logging.getLogger(__name__)

COMPLETE_POLL_S = 0.2

#: At most this many findings are kept in a record and an answer (the count is kept whole).
MAX_FINDINGS = 50


def scan_for_record(path: Path, *, nonfinite_only: bool, workers: int) -> dict[str, Any]:
    """Scan the checkpoint at ``path`` and return what its scan record holds (``result``)."""
    from .scan import prepare_scan, run_scan

    plan, cache = prepare_scan(path, nonfinite_only=nonfinite_only)
    report = run_scan(plan, cache, workers=workers, processes=False)
    findings = [{**f.to_dict(), "description": f.describe()} for f in report.findings]
    return {"path": str(path), "clean": report.clean, "findings": findings[:MAX_FINDINGS],
            "n_findings": len(findings), "checks": [c.value for c in report.checks]}


def handle(request: dict[str, Any]) -> dict[str, Any]:
    """Answer one request: ``{"status": "clean"|"findings"|"unreadable", "findings": [line, ...], "message",
    "reused"}``."""
    from .errors import DsckptError
    from .scan_record import completeness_problem, fingerprint, load_valid_record, write_record

    path = Path(request["path"])
    try:
        end = time.monotonic() + float(request.get("complete_timeout_s", 0.0))
        while (problem := completeness_problem(path)) is not None:
            if not os.path.lexists(path):
                return {"status": "unreadable", "findings": [], "message": "deleted before it was complete"}
            if time.monotonic() >= end:
                return {"status": "unreadable", "findings": [],
                        "message": f"not completely written after {request.get('complete_timeout_s', 0)} s: {problem}"}
            time.sleep(COMPLETE_POLL_S)
        result = load_valid_record(path)
        if result is not None:
            return {**reply_from_result(result), "reused": True}
        before = fingerprint(path)
        result = scan_for_record(path, nonfinite_only=bool(request.get("nonfinite_only")),
                                 workers=int(request.get("workers") or 0))
        if fingerprint(path) != before:
            return {"status": "unreadable", "findings": [],
                    "message": "its files changed while it was scanned (rewritten or deleted); no record written"}
        write_record(path, result)
        return {**reply_from_result(result), "reused": False}
    except (DsckptError, OSError) as e:
        return {"status": "unreadable", "findings": [], "message": str(e).replace("\n", " ")}
    except Exception as e:
        logger.exception("dsckpt scanner: internal error on %s", path)
        return {"status": "unreadable", "findings": [],
                "message": f"internal error ({type(e).__name__}: {e}); this is a dsckpt bug, please report it"}


def reply_from_result(result: dict[str, Any]) -> dict[str, Any]:
    """The answer for a record's ``result`` (one checkpoint's entry of ``scan --all --json``)."""
    if result.get("error"):
        return {"status": "unreadable", "findings": [], "message": str(result["error"])}
    lines = [f"{f.get('check', '?')}: {f.get('description', '')}" for f in result.get("findings", [])]
    return {"status": "findings" if lines else "clean", "findings": lines, "message": None}


def main() -> int:
    logging.basicConfig(level=logging.WARNING, format="dsckpt scanner: %(message)s")
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
