"""Lightning's side of tests/test_lightning.py, run in a subprocess (importing lightning takes ~5 s).

    python tests/lightning_check.py load RESULT.json OUT.ckpt=FIXTURE [...]
        ``Net.load_from_checkpoint(OUT)`` with Lightning's default arguments (strict, ``weights_only=None``, which is
        ``torch.load``'s ``weights_only=True`` on torch >= 2.6), for each export.
    DS_ACCELERATOR=cpu MASTER_PORT=P python tests/lightning_check.py resume RESULT.json FIXTURE RESHARDED_DIR
        ``trainer.fit(Net, ckpt_path=RESHARDED_DIR)`` on one CPU process with the fixture's strategy and precision,
        to step ``RESUME_TO_STEP``; records what was restored and the losses. ``LIGHTNING_CHECK_DEVICES=2`` resumes
        an unresharded fixture on its own 2 ranks instead (by hand, for comparison: every rank writes RESULT).

Each mode writes a JSON result for the test to judge; this script only gathers facts.
"""
from __future__ import annotations

import json
import math
import os
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
FIXTURES = REPO / "tests" / "fixtures"
sys.path.insert(0, str(FIXTURES))
import lightning_models as lm


def load(result: Path, pairs: list[str]) -> None:
    out = []
    for pair in pairs:
        path, fixture = pair.split("=", 1)
        rec: dict = {"ckpt": path, "fixture": fixture}
        try:
            net = lm.Net.load_from_checkpoint(path)  # Lightning's defaults: strict=True, weights_only=None
            sd = torch.load(path)["state_dict"]
            rec.update(ok=True, hparams=dict(net.hparams), hparams_type=type(net.hparams).__name__,
                       weights_equal_file=all(torch.equal(v, sd[k]) for k, v in net.state_dict().items()),
                       names=sorted(net.state_dict()), param_dtypes=sorted({str(p.dtype) for p in net.parameters()}))
        except Exception as e:  # noqa: BLE001 - the test reports it
            rec.update(ok=False, error=f"{type(e).__name__}: {e}"[:2000])
        out.append(rec)
    result.write_text(json.dumps(out, indent=1))


def resume(result: Path, fixture: str, ckpt: str) -> None:
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state
    from lightning.pytorch import Callback, Trainer
    from safetensors.torch import load_file

    spec = lm.LIGHTNING_FIXTURES[fixture]
    truth = load_file(FIXTURES / fixture / "lightning_truth.safetensors")
    rec: dict = {"fixture": fixture, "losses": {}, "mismatched": [], "checked": []}

    class Check(Callback):
        def on_train_start(self, trainer, pl_module):
            rec["global_step_at_start"] = int(trainer.global_step)
            dl = trainer.train_dataloader
            rec["sampler"] = repr((type(dl.sampler).__name__, getattr(dl.sampler, "shuffle", None), vars(dl.sampler).get("num_replicas"), type(dl.batch_sampler).__name__))
            rec["epoch_at_start"] = int(trainer.current_epoch)
            engine = trainer.strategy.model
            opt = engine.optimizer
            if hasattr(opt, "_lazy_init_hp_params_optimizer_state"):
                # ZeRO-1/2 link the optimizer-state fragments lazily at the first step; link them now so that
                # safe_get_full_optimizer_state can read the restored moments (tests/ds_reshard_check.py does the same)
                opt._hp_optimizer_states_linked = False
                opt._lazy_init_hp_params_optimizer_state()
            base = opt.optimizer
            rec["optimizer_step"] = sorted({float(st["step"]) for st in base.state.values() if "step" in st})
            for n, q in engine.module.named_parameters():
                for kind, got in (("param", safe_get_full_fp32_param(q)),
                                  ("exp_avg", safe_get_full_optimizer_state(q, "exp_avg")),
                                  ("exp_avg_sq", safe_get_full_optimizer_state(q, "exp_avg_sq"))):
                    want = truth[f"{kind}/{n}"]
                    rec["checked"].append(f"{kind}/{n}")
                    if got is None or not torch.equal(got.float().cpu(), want):
                        rec["mismatched"].append(f"{kind}/{n}")
            for n, b in engine.module.named_buffers():
                rec["checked"].append(f"buffer/{n}")
                if not torch.equal(b.cpu(), truth[f"buffer/{n}"]):
                    rec["mismatched"].append(f"buffer/{n}")
            rec["lr_scheduler"] = ([c.scheduler.state_dict() for c in trainer.lr_scheduler_configs]
                                   if trainer.lr_scheduler_configs else [])
            rec["callbacks"] = {type(c).__name__: c.state_dict() for c in trainer.callbacks
                                if type(c).__name__ in ("ModelCheckpoint", "EarlyStopping")}

        def on_train_batch_start(self, trainer, pl_module, batch, batch_idx):
            rec.setdefault("batches", {})[int(trainer.global_step) + 1] = batch[1].tolist()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            rec["losses"][int(trainer.global_step)] = float(outputs["loss"])

    callbacks: list = [Check()]
    if spec["monitored"]:
        from lightning.pytorch.callbacks import EarlyStopping, ModelCheckpoint

        # the same callbacks as the saving run, so Lightning restores their state from the checkpoint
        callbacks += [ModelCheckpoint(dirpath=str(result.parent / "resumed-ckpts"), monitor="train_loss", mode="min",
                                      save_top_k=2, every_n_train_steps=lm.SAVE_STEP),
                      EarlyStopping(monitor="train_loss", mode="min", patience=5, check_on_train_epoch_end=True)]
    trainer = Trainer(accelerator="cpu", devices=int(os.environ.get("LIGHTNING_CHECK_DEVICES", "1")), strategy=lm.strategy(spec["stage"]), precision=spec["precision"],
                      max_steps=lm.RESUME_TO_STEP, callbacks=callbacks, logger=False,
                      enable_checkpointing=spec["monitored"], use_distributed_sampler=False, enable_progress_bar=False,
                      enable_model_summary=False, num_sanity_val_steps=0, default_root_dir=str(result.parent))
    trainer.fit(lm.Net(bn=spec["bn"], scheduler=spec["scheduler"]), ckpt_path=ckpt)
    rec["global_step_at_end"] = int(trainer.global_step)
    rec["losses_finite"] = all(math.isfinite(v) for v in rec["losses"].values())
    # the first resumed step's loss, computed here from the saved weights the generator's way: a reference from
    # this machine's kernels, so the test needs no tolerance for another CPU
    meta = json.loads((FIXTURES / fixture / "lightning_truth.json").read_text())
    rec["reference_loss"] = lm.first_batch_loss(
        meta["hyper_parameters"], {k.split("/", 1)[1]: v for k, v in truth.items() if k.startswith("lowp/")},
        {k.split("/", 1)[1]: v for k, v in truth.items() if k.startswith("buffer/")}, spec["precision"])
    result.write_text(json.dumps(rec, indent=1, default=str))


if __name__ == "__main__":
    mode, res = sys.argv[1], Path(sys.argv[2])
    if mode == "load":
        load(res, sys.argv[3:])
    else:
        resume(res, sys.argv[3], sys.argv[4])
