#!/usr/bin/env bash
# to-dcp against dd, to-fp32 and a baseline source on a lent host (bench/README.md, "to-dcp"; issue 42). Staged as
# .gpu/dcpspeed/run.sh beside whl/ (DeepSpeed and its dependencies), new/ (git archive HEAD dsckpt bench
# pyproject.toml) and old/ (git archive BASELINE dsckpt); run with the device tool, carry [".gpu/dcpspeed"]:
#   BUDGET_S=400 bash .gpu/dcpspeed/run.sh          (env: DCP_WORKERS="4 8 16 2", ROUNDS=2, WORK)
set -uo pipefail
cd "$(dirname "$0")"
D=$PWD
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=$(command -v python3)
WORK=${WORK:-$D/work}
mkdir -p "$WORK" "$OUT"
exec > >(tee -a "$OUT/run.log") 2>&1
date; nproc; free -g; df -h "$WORK" | tail -1; "$PY" -V; env | grep -i '^PYTHON' || true
"$PY" -c "import torch, os; d=os.path.dirname(torch.__file__); print(torch.__version__, d, 'writable', os.access(d, os.W_OK), 'pycache', os.path.isdir(os.path.join(d, '__pycache__')))"
TIMEFORMAT='%R s wall'
echo "import torch, as the host has it:"; time "$PY" -c "import torch"
echo "import torch + DCP, as the host has it:"; time "$PY" -c "import torch, torch.distributed.checkpoint"
"$PY" -m pip install -q --no-deps --no-index "$D"/whl/*.whl 2>&1 | tail -2
"$PY" -c "import numpy" 2>/dev/null || "$PY" -m pip install -q --no-deps --no-index "$D"/whl/numpy/*.whl
"$PY" -c "import isal, deepspeed; print('isal', isal.__version__, 'deepspeed', deepspeed.__version__)" 2>&1 | tail -1
export PYTHONPYCACHEPREFIX=$WORK/pycache  # bytecode kept there from now on, as pip leaves it in site-packages
unset PYTHONDONTWRITEBYTECODE
cd "$D/new"
s=$(date +%s)
OMP_NUM_THREADS=2 DS_ACCELERATOR=cpu "$(dirname "$PY")/deepspeed" --num_gpus 8 --master_port 29811 \
    bench/make_checkpoints.py --params 1B --stage 3 --out "$WORK/zero3-1b" > "$OUT/gen.log" 2>&1
echo "generate rc=$? in $(( $(date +%s) - s )) s"; grep -i "wrote" "$OUT/gen.log" | tail -2; ls -la "$WORK/zero3-1b"/*/ | head -20
df -h /dev/shm | tail -1
# BENCH_WORK=/dev/shm/w DROP="" SKIP="ds_to_universal imports dd to-fp32": outputs in memory, the checkpoint in the
# page cache, so the disk is no limit: what the CPU side of each command can write.
mkdir -p "${BENCH_WORK:-$WORK}"
timeout "${BUDGET_S:-420}" "$PY" bench/dcp.py --ckpt "$WORK/zero3-1b" --work "${BENCH_WORK:-$WORK}" --out "$OUT" \
    --dcp-workers ${DCP_WORKERS:-4 8 16 2} --rounds "${ROUNDS:-2}" --baseline-src "$D/old" --pycache "$WORK/pycache" \
    ${CHECK---check} ${DROP---drop-caches} --skip ${SKIP:-ds_to_universal}
echo "bench rc=$?"; date
