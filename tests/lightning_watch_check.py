"""A real Lightning + DeepSpeedStrategy run on 2 CPU ranks with dsckpt's LightningScanCallback (issue 39 item 3).

    DS_ACCELERATOR=cpu MASTER_PORT=P python tests/lightning_watch_check.py OUT_DIR REPORT.json

The fixture's tiny MLP with BatchNorm (tests/fixtures/lightning_models.py, ZeRO-2, fp32), a ModelCheckpoint every 3
steps (``epoch=E-step=N.ckpt`` folders, all kept), a CSVLogger. After step INJECT_STEP every rank writes +inf into
``bn.running_var[1]``: step 3's checkpoint is clean, step 6's and every later one carry it. Rank 0 lets step
INJECT_STEP end only once step 3's scan record is there (so the right checkpoint is checked whatever the machine's
load). Each rank writes REPORT.rankR.json: its global step at the end, the checkpoints it offered, the outcomes.
"""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "fixtures"))
import lightning_models as lm
from lightning.pytorch import Callback, Trainer
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.loggers import CSVLogger

from dsckpt.callbacks import LightningScanCallback
from dsckpt.scan_record import record_path

INJECT_STEP = 4
MAX_STEPS = 600

out, report = Path(sys.argv[1]), Path(sys.argv[2])
ckpts = out / "ckpts"


class Inject(Callback):
    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.global_step != INJECT_STEP:
            return
        if trainer.is_global_zero:
            end = time.monotonic() + 300
            while not record_path(ckpts / "epoch=0-step=3.ckpt").exists() and time.monotonic() < end:
                time.sleep(0.05)
        with torch.no_grad():
            pl_module.bn.running_var[1] = float("inf")


scan_cb = LightningScanCallback(on_finding="stop", wait_at_end_s=300)
trainer = Trainer(accelerator="cpu", devices=2, strategy=lm.strategy(2), precision="32-true", max_steps=MAX_STEPS,
                  max_epochs=-1, callbacks=[scan_cb, Inject(), ModelCheckpoint(dirpath=str(ckpts), save_top_k=-1,
                                                                                every_n_train_steps=3)],
                  logger=CSVLogger(str(out), name="logs", version=0), use_distributed_sampler=False,
                  enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0,
                  default_root_dir=str(out))
trainer.fit(lm.Net(bn=True, scheduler=None))
# every rank writes its own report (the process group may be gone after fit)
rank = trainer.global_rank
Path(f"{report}.rank{rank}.json").write_text(json.dumps({
    "rank": rank, "global_step": int(trainer.global_step), "max_steps": MAX_STEPS,
    "offered": sorted(str(p) for p in scan_cb.session.offered),
    "outcomes": [o.to_dict() for o in scan_cb.session.seen]}, indent=1))
