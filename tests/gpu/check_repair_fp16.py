"""Check that DeepSpeed loads the repaired fp16 BN-overflow checkpoints (needs a CUDA GPU; fp16 engines
do not run on CPU). Two steps:

  1. on any machine with dsckpt (CPU is fine) — repair every fp16 fixture from its recorded fp32 stats:

         python tests/gpu/check_repair_fp16.py prepare /tmp/repaired_fp16

     writes /tmp/repaired_fp16/<fixture>/{ckpt/, expect.safetensors}; fixtures without
     source_fp32.safetensors are skipped (printed).

  2. on the GPU machine (deepspeed installed, repo checked out, 2 GPUs for the *_w2_* fixtures):

         python tests/gpu/check_repair_fp16.py check /tmp/repaired_fp16

     For each repaired checkpoint it launches `deepspeed --num_gpus WS tests/deepspeed_load_check.py`
     twice: with the fixture's own config (data_types.buffer_dtype fp16) and without buffer_dtype.
     One line per run:  PASS|FAIL <fixture> [config] <detail>.  Exit status 0 only if every
     "no-buffer-dtype" run passes and every run's load_checkpoint() succeeded.

Expected: "buffer_dtype=fp16" runs report FAIL "bn.running_var is non-finite in the loaded module"
when the true running_var exceeds 65504 — the file holds the right fp32 value, but DeepSpeed copies it
into the engine's fp16 buffer (module.load_state_dict -> copy_), which overflows again. That run only
counts as a failure if load_checkpoint() itself failed. The "no buffer_dtype" runs must PASS.
"""
import argparse
import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def prepare(out: Path) -> int:
    sys.path.insert(0, str(REPO))
    import torch
    from safetensors.torch import load_file, save_file

    from dsckpt.repair import prepare_repair, run_repair

    out.mkdir(parents=True, exist_ok=True)
    n = 0
    for fx in sorted(FIXTURES.glob("*fp16*")):
        src = fx / "source_fp32.safetensors"
        if not ("bnoverflow" in fx.name or "cpuforced" in fx.name):
            print(f"SKIP {fx.name}: not a BatchNorm-overflow fixture")
            continue
        if not src.exists():
            print(f"SKIP {fx.name}: no source_fp32.safetensors")
            continue
        plan, _ = prepare_repair(fx / "ckpt", src)
        dest = out / fx.name
        run_repair(plan, dest / "ckpt", force=True)
        source = load_file(str(src))
        truth = load_file(str(fx / "truth.safetensors"))
        rv = truth["buffer/bn.running_var"].float().clone()  # stored fp16 values, patched where non-finite
        bad = ~torch.isfinite(rv)
        rv[bad] = source["bn.running_var"].float()[bad]
        expect = {"bn.running_var": rv.contiguous(),
                  "bn.running_mean": truth["buffer/bn.running_mean"].float().contiguous()}
        for name in json.loads((fx / "truth.json").read_text())["params"]:
            expect[name] = truth[f"lowp/{name}"].float().contiguous()
        save_file(expect, str(dest / "expect.safetensors"))
        for p in plan.patches:
            print(f"REPAIRED {fx.name}: {p.describe().splitlines()[0]}")
        n += 1
    print(f"prepared {n} checkpoint(s) in {out}")
    return 0 if n else 1


def check(folder: Path) -> int:
    ok = True
    port = 29700
    launcher = os.environ.get("DEEPSPEED", "deepspeed")
    import torch

    gpus = torch.cuda.device_count()
    for d in sorted(p for p in folder.iterdir() if (p / "ckpt").is_dir()):
        meta = json.loads((FIXTURES / d.name / "truth.json").read_text())
        if meta["world_size"] > gpus:
            print(f"SKIP {d.name}: needs {meta['world_size']} GPUs, {gpus} visible", flush=True)
            continue
        for extra, label in (([], "buffer_dtype=fp16"), (["--no-buffer-dtype"], "no buffer_dtype")):
            port += 1
            cmd = [launcher, "--num_gpus", str(meta["world_size"]), "--master_port", str(port),
                   str(REPO / "tests" / "deepspeed_load_check.py"), "--fixture", d.name, "--ckpt", str(d / "ckpt"),
                   "--expect", str(d / "expect.safetensors"), "--device", "cuda", *extra]
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO)
            lines = [ln for ln in proc.stdout.splitlines() if ln.startswith(("PASS", "FAIL"))]
            if lines:
                line = lines[-1]
            else:
                tail = proc.stderr.strip().splitlines()[-1:] or ["no output"]
                line = f"FAIL {d / 'ckpt'}: no result from load_checkpoint run (rc {proc.returncode}): {tail[0]}"
            status = line.split(" ", 1)[0]
            detail = line.split(": ", 1)[1] if ": " in line else ""
            print(f"{status} {d.name} [{label}] {detail}".rstrip(), flush=True)
            load_failed = "load_checkpoint" in detail or not lines
            if load_failed or (label == "no buffer_dtype" and status != "PASS"):
                ok = False
    return 0 if ok else 1


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("step", choices=["prepare", "check"])
    ap.add_argument("folder", type=Path)
    a = ap.parse_args()
    sys.exit(prepare(a.folder) if a.step == "prepare" else check(a.folder))
