"""The record of what DeepSpeed's own ``ds_to_universal`` writes for the TP, TP x PP and AutoEP fixtures
(``tests/fixtures/ds_to_universal_record.json``, ``tests/fixtures/record_ds_to_universal.py``): complete, able to tell a
changed folder from DeepSpeed's, and (live tier) still what DeepSpeed writes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from universal_record import FIXTURES, ds_to_universal_differences, record, recorder

from dsckpt.cli import main


def test_record_covers_every_tp_pipeline_and_autoep_fixture():
    rec = record()
    assert rec["deepspeed"] == "0.19.8"
    assert sorted(rec["fixtures"]) == recorder().fixtures()
    # ds_to_universal converts ZeRO optimizer files: the AutoTP stage-0 fixtures have none (dsckpt's reshard
    # --universal writes them as the folder of their ZeRO-1 files: test_universal.py test_stage0_source_*)
    assert {fx: r["error"][-1].split(" in directory")[0] for fx, r in rec["fixtures"].items() if r["rc"] != 0} == {
        fx: "FileNotFoundError: can't find *_optim_states.pt files" for fx in rec["fixtures"]
        if fx.startswith("autotp/autotp_z0_")}
    # TP x PP: ds_to_universal copies only mp_rank_{stage * tp + t} (not the layer files) beside zero/
    files = rec["fixtures"]["tp_pipeline/megatron_pp2_tp2_z1_fp32"]["files"]
    assert sorted(f for f in files if f.endswith("_model_states.pt")) == [
        f"global_step3_universal/mp_rank_{m:02d}_model_states.pt" for m in range(4)]


def test_a_changed_value_key_order_or_missing_file_is_told(tmp_path):
    """The comparison can fail: one bf16 ulp in one master, one key moved in a model-states file, one file gone."""
    fx = FIXTURES / "autotp" / "megatron_z1_bf16_tp2_dp1"
    out = tmp_path / "u"
    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(out), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    assert ds_to_universal_differences(fx, out) == []
    tag = out / "global_step3_universal"
    master = next(tag.glob("zero/*/fp32.pt"))
    d = torch.load(master, weights_only=False)
    d["param"].view(-1)[0] = torch.nextafter(d["param"].view(-1)[0], torch.tensor(float("inf")))
    torch.save(d, master)
    ms = tag / "mp_rank_00_model_states.pt"
    d = torch.load(ms, weights_only=False)
    d["module"] = d.pop("module")  # the same keys and values, 'module' last
    torch.save(d, ms)
    step = next(tag.glob("zero/*/step.pt"))
    step.unlink()
    got = ds_to_universal_differences(fx, out)
    assert got[0] == f"missing {step.relative_to(out).as_posix()}", got
    assert any(g.startswith(f"{master.relative_to(out).as_posix()}: line ") for g in got), got
    assert any(g.startswith(f"{ms.relative_to(out).as_posix()}: line ") for g in got), got
    assert len(got) == 3, got


LIVE = ["autotp/megatron_z1_bf16_tp2_dp2_bf16opt", "autoep/autoep_qwen3_z3_bf16_ep2_dp1"]


@pytest.mark.live
@pytest.mark.deepspeed
def test_record_matches_deepspeed_live(tmp_path: Path):
    """ds_to_universal, run now on a Megatron-style TP fixture and an AutoEP ZeRO-3 one, writes what the record says."""
    pytest.importorskip("deepspeed")
    out = tmp_path / "live.json"
    env = {**os.environ, "PYTHONPATH": str(FIXTURES.parent.parent), "DS_ACCELERATOR": "cpu"}
    subprocess.run([sys.executable, str(FIXTURES / "record_ds_to_universal.py"), "--out", str(out), *LIVE],
                   check=True, env=env, capture_output=True, text=True, timeout=600)
    live = json.loads(out.read_text())
    assert live["deepspeed"] == record()["deepspeed"]
    for fx in LIVE:
        got, want = live["fixtures"][fx], record()["fixtures"][fx]
        assert (got["rc"], got["files"]) == (want["rc"], want["files"]), fx


@pytest.mark.live
@pytest.mark.deepspeed
def test_reads_ds_to_universal_folder_of_sub_params_live(tmp_path: Path):
    """ds_to_universal, run now on the Megatron-style GQA fixture (parameter_with_sub_params: it pickles DeepSpeed's
    SubparamShape into the qkv files): its qkv files are byte for byte the ones kept beside the fixture
    (``ds_to_universal_qkv/``, which the default tier compares dsckpt's pickles with), and dsckpt reads its whole
    folder through the allow-list as the run: to-fp32 gives the engine's masters exactly."""
    pytest.importorskip("deepspeed")
    from safetensors.torch import load_file

    fx = FIXTURES / "autotp" / "megatron_z1_fp32_tp2_dp1_gqa"
    out = tmp_path / "u" / "global_step3_universal"
    subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                    str(fx / "ckpt" / "global_step3"), "--output_folder", str(out), "--num_extract_workers", "1",
                    "--num_merge_workers", "1"], check=True, env={**os.environ, "DS_ACCELERATOR": "cpu"},
                   capture_output=True, text=True, timeout=600)
    kept = sorted((fx / "ds_to_universal_qkv").rglob("*.pt"))
    assert len(kept) == 6
    for f in kept:
        assert (out / f.relative_to(fx / "ds_to_universal_qkv")).read_bytes() == f.read_bytes(), f
    r = CliRunner().invoke(main, ["to-fp32", str(tmp_path / "u"), str(tmp_path / "m.safetensors"), "-q"])
    assert r.exit_code == 0, r.output
    got, truth = load_file(str(tmp_path / "m.safetensors")), load_file(str(fx / "truth.safetensors"))
    assert sorted(got) == sorted(json.loads((fx / "truth.json").read_text())["params"])
    assert all(torch.equal(got[n], truth[f"param/{n}"]) for n in got)
