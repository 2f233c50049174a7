#!/usr/bin/env bash
# Issue 35 on a lent 16-core host, in one device call (bench/README.md, "scan and verify against cat"):
# DeepSpeed writes 1B ZeRO-2 and ZeRO-3 checkpoints on CPU ranks, then bench/scan.py times `scan --nonfinite`,
# `scan` and `verify` against `cat`, with the previous dsckpt as [before] in the same rounds, and the per-check costs.
#
#   OUT=$OUT bash bench/scan_gpu.sh          # from a copy of the repository (git archive), with
#                                            # WHL (wheels: deepspeed + deps, isal) and BEFORE (a folder holding
#                                            # the previous dsckpt/) beside it
#
# STAGES ("2 3"), PARAMS (1B), RANKS (8), ROUNDS (3), VARIANTS (block sizes, see bench/scan.py), NO_COSTS=1,
# BUDGET_S (per checkpoint: no new round after it; 2 rounds at least),
# PY (python3), NO_INSTALL=1 (the wheels are installed already: a local trial at a tiny size).
set -uo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-python3}
WHL=${WHL:-../../.whl}
BEFORE=${BEFORE:-../before}
WORK=${WORK:-/tmp/scanbench}
OUT=${OUT:-bench/out/scan-gpu}
PARAMS=${PARAMS:-1B}
RANKS=${RANKS:-8}
ROUNDS=${ROUNDS:-3}
BUDGET_S=${BUDGET_S:-120}
mkdir -p "$OUT" "$WORK"
if [ -z "${NO_INSTALL:-}" ]; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --target /tmp/site "$WHL"/*.whl || exit 1
  export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
fi
{ date -u; nproc; free -g; lscpu | grep -E 'Model name|L2|L3|NUMA node\(s\)'; df -h "$WORK" | tail -1
  "$PY" -c 'import dsckpt.crc as c, numpy, sys; print(sys.version.split()[0], "numpy", numpy.__version__, "crc", c.CRC32_IMPL)'
} > "$OUT/host.txt" 2>&1
for stage in ${STAGES:-2 3}; do
  t0=$(date +%s)
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=$(( $(nproc) / RANKS > 0 ? $(nproc) / RANKS : 1 )) timeout 240 \
    "$PY" -m deepspeed.launcher.runner --num_gpus "$RANKS" --master_port "2925$stage" bench/make_checkpoints.py \
    --params "$PARAMS" --stage "$stage" --out "$WORK/zero$stage-$PARAMS" > "$OUT/gen$stage.log" 2>&1
  echo "zero$stage-$PARAMS: exit $?, $(( $(date +%s) - t0 )) s, $(du -sh "$WORK/zero$stage-$PARAMS" | cut -f1)" \
    | tee -a "$OUT/host.txt"
done
PYTHONUNBUFFERED=1 "$PY" bench/scan.py $(for s in ${STAGES:-2 3}; do echo "$WORK/zero$s-$PARAMS"; done) --rounds "$ROUNDS" \
  --budget-s "$BUDGET_S" --baseline-src "$BEFORE" --block-variants "${VARIANTS:-256:65536}" $([ -n "${NO_COSTS:-}" ] || echo --costs) \
  --blocks 256,1024 \
  --report "$OUT/scan-$PARAMS.json" 2> "$OUT/scan-$PARAMS.err" | tee "$OUT/scan-$PARAMS.md"
tail -3 "$OUT/scan-$PARAMS.err"
rm -rf "$WORK"
