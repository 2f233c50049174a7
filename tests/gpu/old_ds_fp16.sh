#!/bin/bash
# How the ds0{145,169,189}_s*_fp16_w1 fixtures were made (tests/fixtures/README.md, "fp16 on one H100"): run on the
# device machine from a tree with .gpu/oldds/{whl/*.whl, repo/ = copy of dsckpt/ + tests/} carried; writes $OUT/oldds_fp16.tgz.
set -u
G=$PWD/.gpu/oldds
PY=/opt/torch/.venv/bin/python3; [ -x "$PY" ] || PY=$(command -v python3)
export TORCH_CUDA_ARCH_LIST=9.0 NCCL_NVLS_ENABLE=0 DS_BUILD_OPS=0 FIXTURE_TIMEOUT=120
$PY -m pip install -q --no-index --no-deps --target /tmp/common $G/whl/pydantic*.whl $G/whl/annotated*.whl \
  $G/whl/typing_insp*.whl $G/whl/hjson*.whl $G/whl/py_cpuinfo*.whl $G/whl/msgpack*.whl $G/whl/einops*.whl $G/whl/nvidia_ml*.whl
for v in 0.14.5 0.16.9 0.18.9; do $PY -m pip install -q --no-index --no-deps --target /tmp/ds$v $G/whl/deepspeed-$v-*.whl; done
$PY -c "import torch, numpy, safetensors, sys; print(sys.version.split()[0], torch.__version__, torch.version.cuda, torch.cuda.get_device_name(0))"
R=$G/repo; cd $R
mkdir -p /tmp/logs
job() {
  v=$1; port=$2; p=$(echo $v | tr -d .)
  PYTHONPATH=/tmp/ds$v:/tmp/common TORCH_EXTENSIONS_DIR=/tmp/ext$v DEEPSPEED=/tmp/ds$v/bin/deepspeed PY=$PY PORT_BASE=$port \
    timeout 250 bash tests/fixtures/generate_all.sh --ds $v --device cuda > /tmp/logs/gen$v.log 2>&1
  echo "gen $v rc=$?" >> /tmp/logs/gen$v.log
  cp /tmp/fixture_ds${p}_*fp16*.log /tmp/logs/ 2>/dev/null
  if [ $v != 0.14.5 ]; then
    names=$(cd tests/fixtures && ls -d ds${p}_*_fp16_w1 2>/dev/null | while read d; do [ -f $d/truth.json ] && echo $d; done)
    PYTHONPATH=$R:/tmp/ds$v:/tmp/common TORCH_EXTENSIONS_DIR=/tmp/ext$v DEEPSPEED=/tmp/ds$v/bin/deepspeed \
      timeout 100 $PY tests/gpu/check_reshard_fp16.py --world-size 1 --deepspeed /tmp/ds$v/bin/deepspeed $names > /tmp/logs/check$v.log 2>&1
    echo "check $v rc=$?" >> /tmp/logs/check$v.log
  fi
}
job 0.14.5 29610 & job 0.16.9 29620 & job 0.18.9 29630 & wait
for f in /tmp/logs/gen*.log /tmp/logs/check*.log; do echo "=== $f"; grep -E "^===|^\[ds0|^!!!|rc=|^PASS|^FAIL|Error" $f | cut -c1-300 | tail -30; done
tar czf $OUT/oldds_fp16.tgz tests/fixtures/ds0*_fp16_w1 -C /tmp logs
ls -la $OUT
