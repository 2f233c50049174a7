#!/usr/bin/env bash
# issue 20's TP-vs-DP export speed (bench/tp.py) on a lent 16-core host, in one device call:
#   carry .gpu/scale (DeepSpeed + dsckpt deps, bench/README.md "Scale") and .gpu/tp (transformers + its deps)
#   HIDDEN=2048 LAYERS=8 ROUNDS=5 bench/tp_gpu.sh
#   SKIP_EXPORT=1 READERS=1 HIDDEN=2048 LAYERS=6 bench/tp_gpu.sh    # scan/verify/diff only
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PY:-/opt/torch/.venv/bin/python3}
OUT=${OUT:-bench/out/tp-reports}
WORK=${WORK:-bench/out/tpbench}
mkdir -p "$OUT" "$WORK"
"$PY" -m pip install -q --no-deps --no-index .gpu/scale/*.whl .gpu/tp/*.whl
nproc; df -h "$PWD" | tail -1
DS="$(dirname "$PY")/deepspeed"
for tp in 2 1; do
  name=$([ $tp = 2 ] && echo tp2-llama || echo dp2-llama)
  t0=$(date +%s)
  DS_ACCELERATOR=cpu OMP_NUM_THREADS=8 "$DS" --num_gpus 2 --master_port $((29640 + tp)) bench/make_tp_checkpoints.py \
      --tp $tp --out "$WORK/$name" --hidden "${HIDDEN:-2048}" --layers "${LAYERS:-8}" > "$OUT/make-$name.log" 2>&1
  echo "wrote $name in $(( $(date +%s) - t0 )) s: $(du -sh "$WORK/$name" | cut -f1)"
done
if [ -z "${SKIP_EXPORT:-}" ]; then
  "$PY" bench/tp.py --tp "$WORK/tp2-llama" --dp "$WORK/dp2-llama" --rounds "${ROUNDS:-5}" --anchor-rounds "${ANCHOR_ROUNDS:-1}" --ds-workers 8 ${NO_ANCHORS:+--no-anchors} \
      2>&1 | tee "$OUT/tp.txt"
fi
if [ -n "${READERS:-}" ]; then  # scan, verify, diff: TP vs DP-only per input byte (READERS=1)
  "$PY" bench/tp.py --tp "$WORK/tp2-llama" --dp "$WORK/dp2-llama" --rounds "${ROUNDS:-5}" --readers 2>&1 | tee "$OUT/tp-readers.txt"
fi
