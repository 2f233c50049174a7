#!/usr/bin/env bash
# The scale benchmark on a lent GPU host, in one command (bench/README.md, "Scale"):
#
#   bench/scale_gpu.sh STAGE [STAGE ...]        # e.g. 2, then 3 (one device call each: ~8 minutes)
#   NO_CURVE=1 bench/scale_gpu.sh 3              # without the --workers curves (~6 minutes)
#   ONLY="reshard,cp -r" bench/scale_gpu.sh 2    # just those cases, into zero2-extra.json (merged by `report`)
#   CURVE=scan NO_WRITE_STREAMS=1 BASELINE=.gpu/before bench/scale_gpu.sh 3
#                                                # only scan's --workers curve, no dd streams, and `scan [before]`
#                                                # from the dsckpt package in .gpu/before (`git archive`)
#
# The host has torch but no DeepSpeed and no network: the wheels staged here in .gpu/scale/ (git-ignored, sent
# with the device call's `carry`) are installed without an index. Reports and logs go to $OUT (default
# bench/out/scale-reports); `bench/scale.py report $OUT/zero*.json` writes the table into bench/results/results.md.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/opt/torch/.venv/bin/python3}
WHL=${WHL:-.gpu/scale}
OUT=${OUT:-bench/out/scale-reports}
mkdir -p "$OUT"
"$PY" -m pip install -q --no-deps --no-index "$WHL"/*.whl
"$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-index "$WHL"/numpy/*.whl
nproc; free -g; df -h "$PWD" | tail -1
for stage in "$@"; do
  "$PY" bench/scale.py run --stage "$stage" --params "${PARAMS:-1B}" --small "${SMALL:-200M}" \
      --ranks "${RANKS:-8}" --rounds "${ROUNDS:-3}" --out "${WORK:-bench/out/scale}" \
      ${NO_CURVE:+--no-curve} ${CURVE:+--curve "$CURVE"} ${NO_WRITE_STREAMS:+--no-write-streams} \
      ${BASELINE:+--baseline-src "$BASELINE"} ${ONLY:+--only "$ONLY"} \
      --report "$OUT/zero$stage${ONLY:+-extra}.json" 2> >(tee "$OUT/zero$stage${ONLY:+-extra}.log" >&2)
  rm -rf "${WORK:-bench/out/scale}"  # 64 GB disk: one stage's checkpoints at a time
done
