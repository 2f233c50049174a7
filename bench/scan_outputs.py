"""Every fixture's `scan` (all checks, and --nonfinite) and `verify` reports as one JSON document, to compare the
outputs of two versions of dsckpt (issue 35: the one-pass rewrite must not change a finding):

    PYTHONPATH=bench/out/before-a65ba61 python -P bench/scan_outputs.py tests/fixtures > before.json
    PYTHONPATH=.                        python -P bench/scan_outputs.py tests/fixtures > after.json
    PYTHONPATH=.                        python -P bench/scan_outputs.py tests/fixtures --tiny > tiny.json

``--tiny`` shrinks ``scan_engine``'s blocks to 8 bytes and its comparisons to 3 elements, so every block boundary is
crossed. Targets: every folder holding a ``latest`` file, every ``.safetensors`` and ``.bin`` file. A target that
cannot be read gives its error's type and message. The ``target`` field is dropped (paths differ between runs).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path


def main() -> None:
    root = Path(sys.argv[1])
    if "--tiny" in sys.argv[2:]:
        from dsckpt import scan_engine

        scan_engine.BLOCK_NBYTES = 8
        scan_engine.COMPARE_BLOCK_NUMEL = 3
    from dsckpt.scan import scan
    from dsckpt.verify import verify

    targets = sorted({p.parent for p in root.rglob("latest")} | set(root.rglob("*.safetensors"))
                     | set(root.rglob("*.bin")))
    out: dict[str, dict[str, object]] = {}
    for t in targets:
        reports: dict[str, object] = {}
        for name, fn in (("scan", lambda t=t: scan(t).to_dict()),
                         ("scan-nf", lambda t=t: scan(t, nonfinite_only=True).to_dict()),
                         ("verify", lambda t=t: verify(t).to_dict() if t.is_dir() else None)):
            try:
                d = fn()
                if d:
                    d.pop("target", None)
                reports[name] = d
            except Exception as e:  # noqa: BLE001 - the error is part of the output compared
                reports[name] = f"{type(e).__name__}: {e}"
        out[str(t)] = reports
    json.dump(out, sys.stdout, indent=1, sort_keys=True, default=str)


if __name__ == "__main__":
    main()
