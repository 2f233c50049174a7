"""Merge a LoRA into a 7B-shaped base: dsckpt's streamed merge against PEFT's merge_and_unload() + save_pretrained
and against copying the base files (issue 26). Time and peak RSS of each, in its own process.

    python bench/peft_merge.py --work /tmp/peftbench [--dtype bf16] [--layers 32] [--hidden 4096] [--inter 11008]
                               [--vocab 32000] [--r 16] [--rounds 2] [--no-peft]

* base: a Llama-shaped model (``LlamaConfig`` with the given sizes; 7B at the defaults: 6.74e9 params) with random
  weights, written as ``save_pretrained`` would (5 GB safetensors shards + index, config.json); made once per --work;
* adapter: LoRA r=--r (alpha 2r) on q,k,v,o,gate,up,down of every layer, random fp32, in two forms: PEFT's adapter
  folder (the PEFT anchor's input) and the fp32 masters under PeftModel's in-memory names (``...lora_A.default.weight``)
  beside an adapter_config.json, which dsckpt opens as a logical checkpoint (``open_state_dict``): the same interface
  its DeepSpeed readers give the merge, without DeepSpeed on the bench host (the adapter is 0.6% of the bytes);
* copy: ``shutil.copyfile`` of every base file, then fsync (dsckpt fsyncs what it writes);
* dsckpt: ``plan_merge`` + ``run_merge`` (what ``to-fp32 CKPT OUT/ --merge --base BASE`` runs), default settings;
* PEFT: ``AutoModelForCausalLM.from_pretrained(base)``, ``PeftModel.from_pretrained``, ``merge_and_unload()``,
  ``save_pretrained(out)`` (5 GB shards), then fsync.
The page cache is warmed by reading the base once before the timed runs, so every run reads from memory. Each run is
a fresh ``python`` process; peak RSS is its ``ru_maxrss``. Outputs are compared (dsckpt == PEFT, bit for bit) once.
Prints ratios against the copy and PEFT measured in the same run; ``--json`` writes them.
"""
from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _config(a):
    from transformers import LlamaConfig

    return LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.inter,
                       num_hidden_layers=a.layers, num_attention_heads=a.hidden // 128,
                       num_key_value_heads=a.hidden // 128, tie_word_embeddings=False,
                       dtype="bfloat16" if a.dtype == "bf16" else "float32")


def _shapes(a) -> dict[str, tuple[int, ...]]:
    h, i = a.hidden, a.inter
    out = {"model.embed_tokens.weight": (a.vocab, h)}
    for L in range(a.layers):
        p = f"model.layers.{L}."
        out.update({p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (h, h),
                    p + "self_attn.v_proj.weight": (h, h), p + "self_attn.o_proj.weight": (h, h),
                    p + "mlp.gate_proj.weight": (i, h), p + "mlp.up_proj.weight": (i, h),
                    p + "mlp.down_proj.weight": (h, i), p + "input_layernorm.weight": (h,),
                    p + "post_attention_layernorm.weight": (h,)})
    out["model.norm.weight"] = (h,)
    out["lm_head.weight"] = (a.vocab, h)
    return out


def make_inputs(a, work: Path) -> None:
    """The base folder (save_pretrained layout) and the two adapter forms, once per --work."""
    import torch
    from safetensors.torch import save_file

    base = work / "base"
    if (base / "done").is_file():
        return
    shutil.rmtree(base, ignore_errors=True)
    base.mkdir(parents=True)
    dtype = torch.bfloat16 if a.dtype == "bf16" else torch.float32
    g = torch.Generator().manual_seed(0)
    shapes = _shapes(a)
    limit, shard, size, shards = 5_000_000_000, {}, 0, []
    itemsize = 2 if a.dtype == "bf16" else 4

    def flush():
        nonlocal shard, size
        if shard:
            shards.append(shard)
            save_file(shard, str(base / f"tmp-{len(shards)}.safetensors"), metadata={"format": "pt"})
            shard, size = {}, 0

    for name, shape in shapes.items():
        n = 1
        for s in shape:
            n *= s
        if size + n * itemsize > limit:
            flush()
        shard[name] = (torch.randn(shape, generator=g, dtype=torch.float32) * 0.02).to(dtype)
        size += n * itemsize
    flush()
    total = len(shards)
    weight_map = {}
    for i, sh in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{total:05d}.safetensors"
        os.replace(base / f"tmp-{i}.safetensors", base / fname)
        weight_map.update({k: fname for k in sh})
    nbytes = sum(v.numel() * v.element_size() for sh in shards for v in sh.values())
    (base / "model.safetensors.index.json").write_text(json.dumps(
        {"metadata": {"total_size": nbytes}, "weight_map": weight_map}, indent=2))
    _config(a).save_pretrained(base)
    # the adapter: PEFT's folder, and the in-memory names for dsckpt
    lora, masters = {}, {}
    for name, shape in shapes.items():
        mod = name.removesuffix(".weight")
        if not mod.endswith(TARGETS):
            continue
        out_f, in_f = shape
        A = torch.randn((a.r, in_f), generator=g) * 0.01
        B = torch.randn((out_f, a.r), generator=g) * 0.01
        for part, t in (("lora_A", A), ("lora_B", B)):
            lora[f"base_model.model.{mod}.{part}.weight"] = t
            masters[f"base_model.model.{mod}.{part}.default.weight"] = t
    cfg = {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": a.r, "lora_alpha": 2 * a.r, "target_modules": list(TARGETS),
           "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False, "use_rslora": False,
           "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": None, "base_model_name_or_path": None,
           "inference_mode": True, "init_lora_weights": True}
    for d, sd in ((work / "adapter", lora), (work / "masters", masters)):
        shutil.rmtree(d, ignore_errors=True)
        d.mkdir()
        save_file(sd, str(d / ("adapter_model.safetensors" if d.name == "adapter" else "masters.safetensors")))
        (d / "adapter_config.json").write_text(json.dumps(cfg, indent=2))
    (base / "done").write_text("ok")


def _fsync_tree(d: Path) -> None:
    for p in d.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            os.fsync(fd)
            os.close(fd)


def _peak_rss_mb() -> float:
    """This process's peak RSS (VmHWM: unlike ru_maxrss, not inherited from the parent across exec)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_one(mode: str, work: Path, out: Path) -> dict:
    """One measured run, in this process; imports are timed apart (``import_s``)."""
    t_imp = time.perf_counter()
    if mode == "dsckpt":
        sys.path.insert(0, str(REPO))
        import torch  # noqa: F401 - the merge imports it; timed with the imports

        from dsckpt.peft import read_adapter_config
        from dsckpt.peft_merge import plan_merge, run_merge
        from dsckpt.state_dict_files import open_state_dict
    elif mode == "peft":
        from peft import PeftModel
        from transformers import AutoModelForCausalLM
    rss_after_imports = _peak_rss_mb()
    t0 = time.perf_counter()
    if mode == "copy":
        out.mkdir()
        for p in sorted((work / "base").iterdir()):
            shutil.copyfile(p, out / p.name)
        _fsync_tree(out)
    elif mode == "dsckpt":
        logical, cache = open_state_dict(work / "masters" / "masters.safetensors")
        cfg = read_adapter_config(work / "masters")
        plan = plan_merge(logical, cache, cfg, out, base_dir=work / "base")
        run_merge(plan, cache)
    elif mode == "peft":
        model = AutoModelForCausalLM.from_pretrained(work / "base", dtype="auto")
        model = PeftModel.from_pretrained(model, work / "adapter")
        merged = model.merge_and_unload()
        merged.save_pretrained(out, max_shard_size="5GB")
        _fsync_tree(out)
    wall = time.perf_counter() - t0
    return {"mode": mode, "wall_s": round(wall, 2), "import_s": round(t0 - t_imp, 2),
            "peak_rss_mb": round(_peak_rss_mb(), 1), "rss_after_imports_mb": round(rss_after_imports, 1)}


def compare(a: Path, b: Path) -> dict:
    from safetensors import safe_open

    def index(d: Path) -> dict[str, Path]:
        idx = d / "model.safetensors.index.json"
        if idx.is_file():
            return {k: d / v for k, v in json.loads(idx.read_text())["weight_map"].items()}
        return {k: d / "model.safetensors" for k in safe_open(str(d / "model.safetensors"), "pt").keys()}

    ia, ib = index(a), index(b)
    import torch

    diff = [k for k in ia if k not in ib]
    for k in ia:
        if k in ib:
            with safe_open(str(ia[k]), "pt") as fa, safe_open(str(ib[k]), "pt") as fb:
                if not torch.equal(fa.get_tensor(k), fb.get_tensor(k)):
                    diff.append(k)
    return {"tensors": len(ia), "names_equal": sorted(ia) == sorted(ib), "differing": diff[:5],
            "n_differing": len(diff)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--work", required=True)
    p.add_argument("--dtype", choices=["bf16", "fp32"], default="bf16")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--hidden", type=int, default=4096)
    p.add_argument("--inter", type=int, default=11008)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--r", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--no-peft", action="store_true")
    p.add_argument("--json", default=None)
    p.add_argument("--one", nargs=2, metavar=("MODE", "OUT"), help=argparse.SUPPRESS)
    a = p.parse_args()
    work = Path(a.work)
    if a.one:
        print(json.dumps(run_one(a.one[0], work, Path(a.one[1]))))
        return
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    make_inputs(a, work)
    base_nbytes = sum(f.stat().st_size for f in (work / "base").glob("*.safetensors"))
    print(f"inputs ready in {time.perf_counter() - t0:.0f} s: base {base_nbytes / 1e9:.2f} GB ({a.dtype}), "
          f"{a.layers} layers, LoRA r={a.r} on {len(TARGETS)} modules per layer; {os.cpu_count()} cores", flush=True)
    for f in (work / "base").glob("*.safetensors"):  # warm the page cache
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass
    results: dict[str, list[dict]] = {"copy": [], "dsckpt": [], "peft": []}
    modes = ["copy", "dsckpt"] + ([] if a.no_peft else ["peft"])
    for rnd in range(a.rounds):
        for mode in modes:
            if mode == "peft" and rnd > 0:
                continue  # one PEFT run: it is the slow anchor
            out = work / f"out-{mode}"
            shutil.rmtree(out, ignore_errors=True)
            proc = subprocess.run([sys.executable, __file__, "--work", str(work), "--one", mode, str(out)],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                print(proc.stdout[-2000:], proc.stderr[-4000:])
                raise SystemExit(f"{mode} failed")
            r = json.loads(proc.stdout.strip().splitlines()[-1])
            results[mode].append(r)
            print(f"round {rnd}: {mode:6s} {r['wall_s']:8.2f} s (+ {r['import_s']:.2f} s of imports)  peak RSS "
                  f"{r['peak_rss_mb']:8.1f} MB ({r['rss_after_imports_mb']:.1f} MB after imports)", flush=True)
            if mode == "copy":
                shutil.rmtree(out)
    check = compare(work / "out-dsckpt", work / "out-peft") if not a.no_peft else None
    best = {m: min(r["wall_s"] for r in rs) for m, rs in results.items() if rs}
    rss = {m: max(r["peak_rss_mb"] for r in rs) for m, rs in results.items() if rs}
    summary = {"base_gb": round(base_nbytes / 1e9, 2), "dtype": a.dtype, "layers": a.layers, "r": a.r,
               "cores": os.cpu_count(), "best_wall_s": best, "peak_rss_mb": rss, "runs": results,
               "dsckpt_vs_copy": round(best["dsckpt"] / best["copy"], 2),
               "peft_vs_dsckpt": round(best["peft"] / best["dsckpt"], 2) if "peft" in best else None,
               "dsckpt_equals_peft": check}
    print(json.dumps({k: v for k, v in summary.items() if k != "runs"}, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(summary, indent=1))


if __name__ == "__main__":
    main()
