"""What dsckpt's save-time scan costs training: time per step with and without TrainerScanCallback, on CPU ranks.

    /work/venv/bin/python bench/callback_cost.py [--rounds 3] [--max-steps 120] [--save-steps 5]

Each measurement is a fresh ``deepspeed --num_gpus 2`` launch (CPU ranks, gloo, ZeRO-2, bf16) of a Trainer on a
small Llama built from a config (hidden 128, 4 layers: 0.8 M parameters, ~10 MB per checkpoint with its Adam
state), saving every ``--save-steps`` steps, in one of three modes:

* ``none``: no callback (the anchor);
* ``log``: ``TrainerScanCallback()`` -- every save offered to the scanner process, outcomes logged;
* ``stop``: ``TrainerScanCallback(on_finding="stop")`` -- the same, plus one all-reduce of one value per step so
  every rank stops together.

A step's time is from the Trainer's ``on_step_begin`` to its ``on_step_end`` (forward, backward, optimizer step;
the save after some steps is the same in every mode and is not in it). Per mode: the median step time over all
steps, and over the steps during which a scan was running (the scanner process busy when the step ended), each as a
ratio to the anchor's median; the CPU time the rank-0 training process spent per step (all its threads: torch's,
and the callback's own thread; not the scanner process), which the machine's load from others moves far less than
wall time; the train() wall time; and each round's median step, to show the spread. Modes are interleaved (none, log, stop,
then reversed, ...) so load from others on the machine falls on all of them. Writes
``bench/results/callback_cost-<date>.md`` and the raw reports to ``bench/out/callback_cost/``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
MODES = ("none", "log", "stop")
PORT = 29852


def rank_side(a: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    sys.path.insert(0, str(REPO / "tests"))
    sys.path.insert(0, str(REPO / "tests" / "fixtures"))
    import hf_models as hm
    from ds_launch import gloo_only
    from transformers import AutoModelForCausalLM, LlamaConfig, Trainer, TrainerCallback

    gloo_only()
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=hm.VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                      pad_token_id=0, bos_token_id=2, eos_token_id=3)
    model = AutoModelForCausalLM.from_config(cfg)
    targs = hm.training_args(a.out, 2, max_steps=a.max_steps)
    targs.save_steps = a.save_steps
    targs.logging_steps = 1000

    scan_cb = None
    if a.mode != "none":
        from dsckpt.callbacks import TrainerScanCallback

        scan_cb = TrainerScanCallback(on_finding=a.mode, wait_at_end_s=600)

    class Timer(TrainerCallback):
        def __init__(self) -> None:
            self.t0 = self.c0 = 0.0
            self.steps: list[tuple[float, bool, float]] = []

        def on_step_begin(self, args_, state, control, **kw):
            self.t0, self.c0 = time.perf_counter(), time.process_time()

        def on_step_end(self, args_, state, control, **kw):
            dt, dc = time.perf_counter() - self.t0, time.process_time() - self.c0
            s = scan_cb.session._scanner if scan_cb is not None else None
            self.steps.append((dt, s is not None and not s.idle, dc))

    timer = Timer()
    # the Timer last: its on_step_end comes after the scan callback's, so a step's time includes the callback's work
    trainer = Trainer(model=model, args=targs, train_dataset=hm.TokenData(), processing_class=hm.make_tokenizer(),
                      callbacks=[*([scan_cb] if scan_cb else []), timer])
    t0 = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t0
    if dist.get_rank() == 0:
        seen = scan_cb.session.seen if scan_cb is not None else []
        Path(a.report).write_text(json.dumps({
            "mode": a.mode, "train_s": train_s, "steps": timer.steps,
            "scans": sum(o.status.value in ("clean", "findings") for o in seen),
            "skipped": sum(o.status.value == "skipped" for o in seen),
            "scan_s": [o.scan_s for o in seen if o.status.value in ("clean", "findings")]}))
    dist.barrier()


def launch(mode: str, rnd: int, a: argparse.Namespace, out: Path) -> dict:
    report = out / f"{mode}-{rnd}.json"
    run_dir = out / f"run-{mode}-{rnd}"
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONPATH": os.pathsep.join(
        p for p in (str(REPO), os.environ.get("PYTHONPATH", "")) if p)}
    cmd = [str(Path(sys.executable).parent / "deepspeed"), "--num_gpus", "2", "--master_port", str(PORT),
           str(Path(__file__).resolve()), "--rank-side", "--mode", mode, "--out", str(run_dir), "--report",
           str(report), "--max-steps", str(a.max_steps), "--save-steps", str(a.save_steps)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if not report.exists():
        raise SystemExit(f"{mode} round {rnd} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    subprocess.run(["rm", "-rf", str(run_dir)], check=True)
    return json.loads(report.read_text())


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rank-side", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--mode", choices=MODES, default="none")
    ap.add_argument("--out", default=str(HERE / "out" / "callback_cost"))
    ap.add_argument("--report", default="")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--max-steps", type=int, default=120)
    ap.add_argument("--save-steps", type=int, default=5)
    ap.add_argument("--local_rank", type=int, default=0)
    a = ap.parse_args()
    if a.rank_side:
        rank_side(a)
        return
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    rows: dict[str, list[dict]] = {m: [] for m in MODES}
    for rnd in range(a.rounds):
        for mode in (MODES if rnd % 2 == 0 else MODES[::-1]):
            rep = launch(mode, rnd, a, out)
            rows[mode].append(rep)
            med = statistics.median(s[0] for s in rep["steps"]) * 1e3
            print(f"round {rnd} {mode:5s}: median step {med:.1f} ms, train {rep['train_s']:.1f} s, "
                  f"scans {rep.get('scans', 0)}, skipped {rep.get('skipped', 0)}", flush=True)

    def med_ms(reps: list[dict], during_scan: bool | None = None, col: int = 0) -> float:
        vals = [s[col] for r in reps for s in r["steps"] if during_scan is None or s[1] == during_scan]
        return statistics.median(vals) * 1e3 if vals else float("nan")

    anchor = med_ms(rows["none"])
    anchor_cpu = med_ms(rows["none"], col=2)
    load = os.getloadavg()
    lines = [f"# TrainerScanCallback cost per training step ({datetime.date.today()})", "",
             f"`bench/callback_cost.py --rounds {a.rounds} --max-steps {a.max_steps} --save-steps {a.save_steps}`: "
             f"2 CPU ranks (DeepSpeed 0.19.8, gloo, ZeRO-2, bf16), {os.cpu_count()} cores shared with other work "
             f"(load average at the end: {load[0]:.1f}). Step = on_step_begin -> on_step_end; medians over every "
             "step of every round.", "",
             "| mode | median step (ms) | vs none | median step while a scan ran (ms) | vs none | CPU per step, rank 0 "
             "(ms) | vs none | steps with a scan running | train() wall (s, median) | scans done / skipped ahead "
             "(total) | scan time (s, median) | median step per round (ms) |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for m in MODES:
        reps = rows[m]
        during = med_ms(reps, True) if m != "none" else float("nan")
        n_steps = sum(len(r["steps"]) for r in reps)
        n_during = sum(s[1] for r in reps for s in r["steps"])
        scan_s = [x for r in reps for x in r.get("scan_s", [])]
        during_col = f"{during:.1f} | {during / anchor:.3f}" if m != "none" else "- | -"
        scans_col = f"{sum(r['scans'] for r in reps)} / {sum(r['skipped'] for r in reps)}" if m != "none" else "-"
        scan_col = f"{statistics.median(scan_s):.2f}" if scan_s else "-"
        cpu = med_ms(reps, col=2)
        per_round = ", ".join(f"{med_ms([r]):.0f}" for r in reps)
        lines.append(f"| {m} | {med_ms(reps):.1f} | {med_ms(reps) / anchor:.3f} | {during_col} | {cpu:.1f} | "
                     f"{cpu / anchor_cpu:.3f} | {n_during}/{n_steps} | {statistics.median(r['train_s'] for r in reps):.1f}"
                     f" | {scans_col} | {scan_col} | {per_round} |")
    text = "\n".join(lines) + "\n"
    print(text)
    dest = HERE / "results" / f"callback_cost-{datetime.date.today()}.md"
    dest.write_text(text)
    print(f"wrote {dest}")


if __name__ == "__main__":
    main()
