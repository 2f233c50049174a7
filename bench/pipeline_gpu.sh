#!/usr/bin/env bash
# issue 32's pipeline benchmark (bench/pipeline.py) on a lent host, in one device call. From /work/main:
#   git -C WORKTREE archive HEAD | tar -x -C .gpu/pipeline/src ; click and safetensors wheels in .gpu/pipeline/wheels
#   (the host has torch, not them); carry [".gpu/pipeline", ".whl"]
#   bash .gpu/pipeline/src/bench/pipeline_gpu.sh        (HIDDEN=8192 LAYERS=15: 1.007B params)
set -euo pipefail
ROOT=$(pwd)
SRC=${SRC:-$ROOT/.gpu/pipeline/src}
OUTDIR=${OUT:-$ROOT/bench-out}
WORK=${WORK:-/tmp/ppbench}
mkdir -p "$OUTDIR" "$WORK"
python3 -m pip install -q --no-deps --no-index "$ROOT"/.whl/*.whl "$ROOT"/.gpu/pipeline/wheels/*.whl 2>&1 | tail -2 || true
python3 -c "import torch, deepspeed, click, safetensors; print('torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
nproc; free -g | head -2; df -h "$WORK" | tail -1
cd "$SRC"
t0=$(date +%s)
DS_ACCELERATOR=cpu OMP_NUM_THREADS=8 python3 -m deepspeed.launcher.runner --num_gpus 2 --master_port 29531 \
    bench/make_pipeline_checkpoint.py --out "$WORK/pp2" --hidden "${HIDDEN:-8192}" --layers "${LAYERS:-15}" \
    > "$OUTDIR/make.log" 2>&1 || { tail -30 "$OUTDIR/make.log"; exit 1; }
grep "wrote" "$OUTDIR/make.log" | tail -1
echo "made the checkpoint in $(( $(date +%s) - t0 )) s: $(du -sh "$WORK/pp2" | cut -f1)"
python3 bench/pipeline.py --ckpt "$WORK/pp2" --rounds "${ROUNDS:-1}" --json "$OUTDIR/pipeline.json" 2>&1 \
    | tee "$OUTDIR/pipeline.txt"
