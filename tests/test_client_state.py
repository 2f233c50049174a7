"""Findings vs client-state notes (issue 19): a non-finite value a trainer keeps for itself (Lightning's
ModelCheckpoint ``kth_value`` / EarlyStopping ``best_score`` start at +inf, a ReduceLROnPlateau ``best`` is
Python inf) is a note that names its key path, never a finding. Checked on the real DeepSpeed fixture
``s2_bf16_w2_clientstate`` (saved with Lightning-shaped ``client_state``); planted values go into copies."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import all_fixtures
from scan_helpers import copy_fixture, plant

from dsckpt.cli import main
from dsckpt.layout import Owner, key_owner
from dsckpt.model import Role
from dsckpt.scan import StoredKind, nonfinite_scalars, scan
from dsckpt.stand_ins import DeepSpeedObject
from dsckpt.verify import verify

FX = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_clientstate")
MS = "mp_rank_00_model_states.pt"


@pytest.mark.parametrize("file_name,key,owner", [
    (MS, ("callbacks", "ModelCheckpoint{...}", "kth_value"), Owner.CLIENT_STATE),
    (MS, ("lr_schedulers", 0, "best"), Owner.CLIENT_STATE),
    (MS, ("loops", "fit_loop"), Owner.CLIENT_STATE),
    (MS, ("lr_scheduler", "best"), Owner.CLIENT_STATE),  # DeepSpeed's scheduler: the trainer's, not the model
    (MS, ("iteration",), Owner.CLIENT_STATE),  # Megatron-DeepSpeed's client_state
    ("zero_pp_rank_1_mp_rank_00_model_states.pt", ("callbacks", "x"), Owner.CLIENT_STATE),
    (MS, ("module", "fc1.weight"), Owner.MODEL),
    (MS, ("optimizer", "cur_scale"), Owner.MODEL),  # stage-0 loss scale
    (MS, ("frozen_param_fragments", "frozen.weight"), Owner.MODEL),
    (MS, ("ds_config", "steps_per_print"), Owner.CONFIG),  # the HF Trainer passes inf
    ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", ("callbacks",), Owner.MODEL),  # never merged there
    ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", ("optimizer_state_dict", "loss_scaler", "cur_scale"),
     Owner.MODEL),
    ("bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", ("ds_config", "x"), Owner.CONFIG),
    ("layer_01-model_states.pt", ("weight",), Owner.MODEL),
    ("layer_0_expert_1_mp_rank_00_model_states.pt", ("x.weight",), Owner.MODEL),
    (MS, (), Owner.MODEL),
], ids=lambda v: str(v) if not isinstance(v, tuple) else "/".join(map(str, v)))
def test_key_owner_rule(file_name, key, owner):
    assert key_owner(file_name, key) is owner


def test_python_float_scalars_classified_by_key_path():
    """Python floats: a client one is a note; an inf loss scale is DeepSpeed's optimizer data, a finding;
    ds_config is configuration and is not looked at."""
    scaler = DeepSpeedObject()
    scaler.__dict__.update(cur_scale=math.inf, min_scale=1.0)
    trees = {
        Path(MS): {"lr_schedulers": [{"best": math.inf, "eps": 1e-8}], "ds_config": {"steps_per_print": math.inf},
                   "optimizer": {"cur_scale": math.nan}},
        Path("zero_pp_rank_0_mp_rank_00_optim_states.pt"): {"optimizer_state_dict": {"loss_scaler": scaler}},
    }
    got = sorted((f.file.name, f.key_str, f.kind, f.nan, f.posinf, f.neginf) for f in nonfinite_scalars(trees))
    assert got == [
        (MS, "['lr_schedulers'][0]['best']", StoredKind.CLIENT_STATE, 0, 1, 0),
        (MS, "['optimizer']['cur_scale']", StoredKind.OTHER, 1, 0, 0),
        ("zero_pp_rank_0_mp_rank_00_optim_states.pt", "['optimizer_state_dict']['loss_scaler']['cur_scale']",
         StoredKind.OTHER, 0, 1, 0),
    ]


def _expected_paths() -> list[str]:
    """The recorded truth: key paths of the non-finite client values passed to save_checkpoint."""
    return sorted("".join(f"[{k!r}]" for k in p[:-1]) for p in FX.meta["client_state_nonfinite"])


def test_real_lightning_client_state_is_notes_not_findings():
    report = scan(FX.ckpt)
    assert report.findings == () and report.clean
    assert sorted(f.key_str for f in report.client_state) == _expected_paths()
    assert len(_expected_paths()) == 4  # kth_value, best_score (tensors); best, mode_worse (Python floats)
    assert {(f.kind, f.file.name, f.posinf) for f in report.client_state} == {(StoredKind.CLIENT_STATE, MS, 1)}
    assert {f.dtype for f in report.client_state} == {"float32", "python float"}


def test_cli_scan_exit_0_with_notes_on_stdout_and_json():
    r = CliRunner().invoke(main, ["scan", str(FX.ckpt), "--nonfinite", "-q"])
    assert r.exit_code == 0, r.output
    assert r.stderr == ""
    assert "clean: nothing found in model or optimizer data" in r.stdout
    assert ("note          client state mp_rank_00_model_states.pt ['callbacks'][\"EarlyStopping{'monitor': "
            "'val_loss', 'mode': 'min'}\"]['best_score']: float32, 1 +inf of 1 values") in r.stdout
    assert "['lr_schedulers'][0]['best']: python float, 1 +inf of 1 values" in r.stdout
    doc = json.loads(CliRunner().invoke(main, ["scan", str(FX.ckpt), "--json"]).stdout)
    assert doc["clean"] is True and doc["findings"] == [] and doc["notes"] == []
    assert sorted(n["key"] for n in doc["client_state_nonfinite"]) == _expected_paths()
    assert {n["kind"] for n in doc["client_state_nonfinite"]} == {"client state"}


def test_cli_verify_ok_with_client_state_notes():
    r = CliRunner().invoke(main, ["verify", str(FX.ckpt)])
    assert r.exit_code == 0, r.output
    assert "note: client state mp_rank_00_model_states.pt ['lr_schedulers'][0]['mode_worse']" in r.stdout
    doc = verify(FX.ckpt).to_dict()
    assert doc["ok"] and doc["problems"] == []
    assert sorted(n["key"] for n in doc["client_state_nonfinite"]) == _expected_paths()


def test_cli_repair_has_nothing_to_repair_in_client_state(tmp_path):
    r = CliRunner().invoke(main, ["repair", str(FX.ckpt), str(tmp_path / "out"), "--from", "master"])
    assert r.exit_code == 0, r.output
    assert "nothing to repair" in r.stdout
    assert not (tmp_path / "out").exists()


def test_real_inf_in_a_weight_next_to_client_state_is_still_a_finding(tmp_path):
    ckpt = copy_fixture(FX, tmp_path)
    plant(ckpt, "fc1.weight", Role.MODULE, 3, math.inf)
    r = CliRunner().invoke(main, ["scan", str(ckpt), "--nonfinite", "--json"])
    assert r.exit_code == 1, r.output
    doc = json.loads(r.stdout)
    assert [(f["name"], f["kind"], f["posinf"], f["first_indices"]) for f in doc["findings"]] == [
        ("fc1.weight", "param", 1, [3])]
    assert len(doc["client_state_nonfinite"]) == 4
    v = CliRunner().invoke(main, ["verify", str(ckpt), "--json"])
    assert v.exit_code == 1
    assert [p["where"] for p in json.loads(v.stdout)["problems"] if "nonfinite" in p["message"]] == ["fc1.weight"]


def test_real_fp16_overflow_fixture_still_exits_1():
    fx = next(f for f in all_fixtures() if f.name == "s2_fp16_w1_bnoverflow")
    r = CliRunner().invoke(main, ["scan", str(fx.ckpt), "--nonfinite", "--json"])
    assert r.exit_code == 1
    doc = json.loads(r.stdout)
    assert [f["name"] for f in doc["findings"]] == ["bn.running_var"] and doc["client_state_nonfinite"] == []


# Real Lightning 2.6 DeepSpeedStrategy checkpoints, when the Lightning fixtures (branch ``lightning``) are present;
# this file does not depend on them. Each ModelCheckpoint dirpath is given as the user knows it (a run folder).
LIGHTNING_DIRPATHS = sorted({p.parent.parent for p in Path(__file__).parent.glob("fixtures/lightning_*/**/*.ckpt/latest")})


@pytest.mark.skipif(not LIGHTNING_DIRPATHS, reason="no Lightning fixtures in this checkout")
@pytest.mark.parametrize("dirpath", LIGHTNING_DIRPATHS,
                         ids=[p.relative_to(Path(__file__).parent / "fixtures").as_posix() for p in LIGHTNING_DIRPATHS])
def test_real_lightning_checkpoints_scan_clean_with_client_state_notes(dirpath):
    r = CliRunner().invoke(main, ["scan", str(dirpath), "--json", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["findings"] == [] and doc["run_folder"]["kind"] == "Lightning ModelCheckpoint dirpath"
    assert all(n["kind"] == "client state" and n["key"].startswith(("['callbacks']", "['lr_schedulers']", "['loops']"))
               for n in doc["client_state_nonfinite"]), doc["client_state_nonfinite"]
    assert any("['kth_value']" in n["key"] or "['best_model_score']" in n["key"] for n in doc["client_state_nonfinite"])
    v = CliRunner().invoke(main, ["verify", str(dirpath)])
    assert v.exit_code == 0, v.output
