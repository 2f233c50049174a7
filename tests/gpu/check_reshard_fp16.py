"""Reshard the fp16 fixtures with dsckpt and resume them with real DeepSpeed on GPUs (fp16 engines do not
run on CPU). Standalone; needs a CUDA machine with deepspeed + dsckpt installed and this repo checked out:

    python tests/gpu/check_reshard_fp16.py                     # every fp16 fixture present, N = GPU count
    python tests/gpu/check_reshard_fp16.py --world-size 1 s2_fp16_w1_masterinf s1_fp16_w2_bnoverflow

For each fixture (default: every fixture whose truth.json says dtype fp16 and whose ckpt/ exists) it runs
`dsckpt`'s library reshard to N ranks (N defaults to the number of visible GPUs; with 1 GPU a w2 fixture is
a real 2->1 reshard and a w1 fixture a same-size rewrite of every file), then ONE launch of

    deepspeed --num_gpus N --master_port P tests/ds_reshard_check.py --device cuda --result R  NAME=DIR ...

which calls plain engine.load_checkpoint(), compares fp32 master, exp_avg, exp_avg_sq (fragment API and the
optimizer's flat partitions), 16-bit module weights, frozen params, buffers, Adam step, global steps,
the dynamic loss scale against truth.safetensors/truth.json exactly, then trains one more step.
Prints one line per fixture:  PASS|FAIL <fixture> -> N ranks ...   Exit status 0 only if all pass.
"""
import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
FIXTURES = REPO / "tests" / "fixtures"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("fixtures", nargs="*", help="fixture names (default: every fp16 fixture present)")
    ap.add_argument("--world-size", type=int, default=None, help="target ranks (default: GPU count)")
    ap.add_argument("--work", default=None, help="where to write resharded checkpoints (default: a temp dir)")
    ap.add_argument("--deepspeed", default=os.environ.get("DEEPSPEED", "deepspeed"), help="launcher")
    args = ap.parse_args()
    sys.path.insert(0, str(REPO))
    import torch

    from dsckpt.readers import FileCache, read_checkpoint
    from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

    world = args.world_size or torch.cuda.device_count()
    if world < 1:
        print("FAIL no CUDA GPU visible; fp16 DeepSpeed engines need one")
        return 1
    names = args.fixtures or sorted(
        p.parent.name for p in FIXTURES.glob("*/truth.json")
        if json.loads(p.read_text()).get("dtype") == "fp16" and (p.parent / "ckpt").is_dir())
    if not names:
        print("FAIL no fp16 fixtures found under tests/fixtures (generate them with "
              "tests/fixtures/generate_all.sh --device cuda)")
        return 1
    work = Path(args.work or tempfile.mkdtemp(prefix="dsckpt_reshard_fp16_"))
    pairs, failed = [], 0
    for name in names:
        meta = json.loads((FIXTURES / name / "truth.json").read_text())
        out = work / f"{name}_to{world}"
        try:
            cache = FileCache()
            ckpt = read_checkpoint(FIXTURES / name / "ckpt", cache=cache)
            plan = plan_reshard(ckpt, world, facts=read_source_facts(ckpt, cache))
            res = run_reshard(plan, out, cache=cache, force=True)
            print(f"resharded {name}: {meta['dp_world_size']} -> {world} ranks, verified {res.verified_tensors} "
                  f"tensors, {out}", flush=True)
            pairs.append(f"{name}={out}")
        except Exception as e:  # noqa: BLE001 - report every fixture
            print(f"FAIL {name} -> {world} ranks: reshard raised {type(e).__name__}: {e}", flush=True)
            failed += 1
    if pairs:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        result = work / "result.json"
        cmd = [args.deepspeed, "--num_gpus", str(world), "--master_port", str(port),
               str(REPO / "tests" / "ds_reshard_check.py"), "--device", "cuda", "--result", str(result), *pairs]
        print("running: " + " ".join(cmd), flush=True)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        env.pop("DS_ACCELERATOR", None)
        proc = subprocess.run(cmd, cwd=work, env=env, capture_output=True, text=True)
        results = json.loads(result.read_text()) if result.exists() else []
        for r in results:
            print(("PASS " if r["ok"] else "FAIL ") + f"{r['fixture']} -> {r['world_size']} ranks"
                  + ("" if r["ok"] else ": " + "; ".join(r["problems"][:8])), flush=True)
        failed += sum(not r["ok"] for r in results)
        if not results or proc.returncode not in (0, 1):
            print(f"FAIL deepspeed launch exited {proc.returncode}; last output:\n"
                  + (proc.stdout[-4000:] + proc.stderr[-4000:]), flush=True)
            failed += 1
    print(f"{'PASS' if not failed else 'FAIL'} summary: {len(pairs)} resharded, {failed} failure(s); work dir {work}")
    return 0 if not failed else 1


if __name__ == "__main__":
    sys.exit(main())
