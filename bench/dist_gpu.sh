#!/usr/bin/env bash
# issue 21's measurement on a lent 16-core host (bench/distributed.py), in one device call:
#   bench/dist_gpu.sh            # wheels from .gpu/scale (bench/README.md, "Scale"), report into $OUT
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/opt/torch/.venv/bin/python3}
WHL=${WHL:-.gpu/scale}
OUT=${OUT:-bench/out/dist-reports}
mkdir -p "$OUT"
"$PY" -m pip install -q --no-deps --no-index "$WHL"/*.whl
"$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-index "$WHL"/numpy/*.whl
nproc; free -g; df -h "$PWD" | tail -1
"$PY" bench/distributed.py run --stage "${STAGE:-3}" --params "${PARAMS:-1B}" --ranks "${RANKS:-8}" \
    --rounds "${ROUNDS:-2}" --reverse-first "${REVERSE:-0}" --budget-s "${BUDGET_S:-300}" --out "${WORK:-bench/out/dist}" \
    --report "$OUT/dist${TAG:-}.json" 2> >(tee "$OUT/dist${TAG:-}.log" >&2)
