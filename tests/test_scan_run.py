"""``scan --all`` (issue 39 item 1), the scan record (``dsckpt.scan_record``) and training-state health (item 2):
against the run fixtures of ``tests/fixtures/runs`` (``generate_run.py``; truth per checkpoint recorded from the
DeepSpeed engine when it saved) and the fp16 fixtures' recorded loss scale."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest

from dsckpt.cli import main
from dsckpt.scan import scan
from dsckpt.scan_record import (
    RECORD_NAME,
    RunCheckpointKind,
    checkpoint_complete,
    completeness_problem,
    fingerprint,
    list_run_checkpoints,
    load_valid_record,
    record_path,
    write_record,
)
from dsckpt.scan_run import RunStatus, check_checkpoint, scan_run
from dsckpt.training_state import REPAIR_HINT, LossScaler, TrainingState

RUNS = FIXTURES / "runs"
DS_RUN = RUNS / "run_s2_bf16_w2_bnnan"
HF_RUN = RUNS / "run_hf_s2_bf16_w2_bnnan"
RESET = RUNS / "s2_bf16_w2_statereset"
LIGHTNING_RUN = RUNS / "run_lightning_s2_fp32_w2_bnnan"
RUN_FIXTURES = [DS_RUN, HF_RUN, LIGHTNING_RUN]


def run_dir(fx: Path) -> Path:
    """The folder a user passes to scan --all: the save dir / output_dir, or the Lightning dirpath."""
    return fx / ("ckpts" if fx == LIGHTNING_RUN else "run")


def truth(fx: Path) -> dict:
    return json.loads((fx / "truth.json").read_text())


def copy_run(fx: Path, tmp_path: Path) -> Path:
    dest = tmp_path / fx.name
    shutil.copytree(fx / "run", dest)  # copy2: file times kept, in order
    return dest


# --------------------------------------------------------------------------------------------
# the run as the engine saved it


@pytest.mark.parametrize("fx", RUN_FIXTURES, ids=lambda p: p.name)
def test_scan_all_matches_the_truth_of_every_checkpoint(fx):
    t = truth(fx)
    report = scan_run(run_dir(fx), workers=0)
    assert [e.path.name for e in report.checkpoints] == [c["path"] for c in t["checkpoints"]]
    for e, c in zip(report.checkpoints, t["checkpoints"]):
        bad_buffers = sorted(n for n, k in c["buffers"].items() if k)
        assert e.global_steps == e.step == c["global_steps"]
        assert e.skipped_steps == c["skipped_steps"]
        assert e.loss_scale is None  # bf16, fp32
        assert e.clean is (c["nonfinite_values"] == 0)
        assert e.findings == len(bad_buffers) + sum(1 for d in c["params"].values() for v in d.values() if v)
        assert sorted(d.split(":")[0].split(" ", 1)[1] for d in e.details) == bad_buffers
        assert not e.reused_record
    poison = t["poison_step"]
    assert report.last_clean is not None and report.last_clean.step == poison - 1
    assert report.first_with_findings is not None and report.first_with_findings.step == poison


def test_scan_all_cli_json_paths_as_the_user_passes_them(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent.parent)
    run = "tests/fixtures/runs/run_hf_s2_bf16_w2_bnnan/run"
    res = CliRunner().invoke(main, ["scan", "--all", "--json", run, "--workers", "0"])
    assert res.exit_code == 1, res.output
    out = json.loads(res.stdout)
    assert out["last_clean"] == f"{run}/checkpoint-3"
    assert out["first_with_findings"] == f"{run}/checkpoint-4"
    assert [c["path"] for c in out["checkpoints"]] == [f"{run}/checkpoint-{n}" for n in range(1, 7)]
    first = out["checkpoints"][0]
    assert {"path", "step", "findings", "loss_scale", "skipped_steps"} <= set(first)
    assert [c["findings"] for c in out["checkpoints"]] == [0, 0, 0, 2, 2, 2]
    assert [c["skipped_steps"] for c in out["checkpoints"]] == [0, 0, 0, 1, 1, 1]
    # the path printed works as another command's input
    assert CliRunner().invoke(main, ["scan", "-q", out["last_clean"]]).exit_code == 0


def test_scan_all_text_one_line_per_checkpoint(monkeypatch):
    monkeypatch.chdir(FIXTURES.parent.parent)
    res = CliRunner().invoke(main, ["scan", "--all", "tests/fixtures/runs/run_s2_bf16_w2_bnnan/run"])
    assert res.exit_code == 1
    lines = res.stdout.splitlines()
    assert len(lines) == 2 + 6 + 2
    assert lines[-2] == "last clean:          tests/fixtures/runs/run_s2_bf16_w2_bnnan/run/global_step3 (step 3)"
    assert lines[-1] == "first with findings: tests/fixtures/runs/run_s2_bf16_w2_bnnan/run/global_step4 (step 4)"
    assert "2 finding(s): nonfinite bn.running_mean (buffer, 1 +inf); nonfinite bn.running_var (buffer, 1 NaN)" \
        in lines[5]


def test_scan_all_usage():
    r = CliRunner().invoke(main, ["scan", "--all", "--tag", "global_step1", str(DS_RUN / "run")])
    assert r.exit_code == 2 and "neither --tag nor --distributed" in r.output
    r = CliRunner().invoke(main, ["scan", "--all", str(FIXTURES / "runs")])
    assert r.exit_code == 2 and "holds no checkpoint" in r.output


def test_nonfinite_only_run():
    report = scan_run(DS_RUN / "run", nonfinite_only=True, workers=0)
    assert [e.checks for e in report.checkpoints] == [("nonfinite",)] * 6
    assert report.first_with_findings is not None and report.first_with_findings.step == 4


# --------------------------------------------------------------------------------------------
# bad input: a clear line for that checkpoint, the others still scanned, nothing written


def test_damaged_checkpoint_is_its_own_line(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    victim = run / "global_step2" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    before = tree_digest(run)
    report = scan_run(run, workers=0)
    assert tree_digest(run) == before
    by = {e.path.name: e for e in report.checkpoints}
    assert by["global_step2"].status is RunStatus.UNREADABLE
    assert "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt" in by["global_step2"].details[0]
    assert [by[f"global_step{n}"].status for n in (1, 3)] == [RunStatus.CLEAN] * 2
    assert report.last_clean.path.name == "global_step3"
    assert report.first_with_findings.path.name == "global_step2"


def test_missing_rank_file_is_incomplete(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    (run / "global_step5" / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    assert not checkpoint_complete(run / "global_step5")
    report = scan_run(run, workers=0)
    e = report.checkpoints[4]
    assert e.status is RunStatus.INCOMPLETE and "dp_world_size=2" in e.details[0], e.details
    assert report.checkpoints[5].status is RunStatus.FINDINGS


def test_save_newer_than_latest_is_incomplete(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    shutil.copytree(run / "global_step6", run / "global_step7")  # files written after 'latest'
    later = (run / "latest").stat().st_mtime_ns + 10**9
    for f in (run / "global_step7").iterdir():
        os.utime(f, ns=(later, later))
    assert [checkpoint_complete(run / f"global_step{n}") for n in (5, 6, 7)] == [True, True, False]
    assert "names 'global_step6'" in completeness_problem(run / "global_step7")
    e = scan_run(run, workers=0).checkpoints[-1]
    assert e.path.name == "global_step7" and e.status is RunStatus.INCOMPLETE


def test_save_dir_without_latest_still_scanned(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    (run / "latest").unlink()
    report = scan_run(run, workers=0)
    assert [e.status for e in report.checkpoints] == [RunStatus.CLEAN] * 3 + [RunStatus.FINDINGS] * 3
    assert all("holds no 'latest'" in e.notes[0] for e in report.checkpoints)


def test_trainer_checkpoint_without_latest_is_incomplete(tmp_path):
    run = copy_run(HF_RUN, tmp_path)
    (run / "checkpoint-2" / "latest").unlink()
    report = scan_run(run, workers=0)
    assert report.checkpoints[1].status is RunStatus.INCOMPLETE
    assert report.last_clean.path.name == "checkpoint-3"
    assert report.first_with_findings.path.name == "checkpoint-2"


def test_unrelated_run_in_the_same_folder(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    shutil.copytree(FIXTURES / "hf_llama_z2_bf16_w2" / "ckpt" / "global_step3", run / "global_step10")
    report = scan_run(run, workers=0)
    e = report.checkpoints[-1]
    assert e.path.name == "global_step10" and e.status is RunStatus.UNRELATED
    assert "another model" in e.summary
    assert report.first_with_findings.path.name == "global_step4"  # the unrelated one takes no part


def test_changed_while_read(tmp_path, monkeypatch):
    import dsckpt.scan as scan_mod

    run = copy_run(DS_RUN, tmp_path)
    real = scan_mod.run_scan

    def touching(plan, cache, **kw):
        if plan.target.name == "global_step2":
            f = plan.target / "mp_rank_00_model_states.pt"
            os.utime(f, ns=(1, 1))
        return real(plan, cache, **kw)

    monkeypatch.setattr(scan_mod, "run_scan", touching)
    report = scan_run(run, workers=0)
    assert report.checkpoints[1].status is RunStatus.CHANGED
    assert report.first_with_findings.path.name == "global_step2"


def test_lightning_dirpath_with_a_ckpt_that_is_not_lightnings(tmp_path):
    dirpath = tmp_path / "ckpts"
    shutil.copytree(FIXTURES / "lightning_z2_bf16_w2" / "ckpts", dirpath)
    (dirpath / "epoch=1-step=6.ckpt").write_bytes(b"not a checkpoint")
    before = tree_digest(dirpath)
    listed = list_run_checkpoints(dirpath)
    assert [(c.path.name, c.step, c.kind) for c in listed] == [
        ("epoch=0-step=3.ckpt", 3, RunCheckpointKind.LIGHTNING_CKPT),
        ("epoch=1-step=6.ckpt", 6, RunCheckpointKind.LIGHTNING_CKPT)]
    report = scan_run(dirpath, workers=0)
    assert report.checkpoints[0].status is RunStatus.CLEAN
    assert report.checkpoints[1].status is RunStatus.UNREADABLE
    assert "epoch=1-step=6.ckpt" in report.checkpoints[1].details[0]
    assert tree_digest(dirpath) == before


def test_listing_orders_steps_as_numbers(tmp_path):
    for n in (10, 9, 100):
        (tmp_path / f"checkpoint-{n}").mkdir()
    assert [c.step for c in list_run_checkpoints(tmp_path)] == [9, 10, 100]
    assert list_run_checkpoints(tmp_path / "nothing") == []


# --------------------------------------------------------------------------------------------
# the scan record


def test_record_written_beside_the_rank_files_and_reused(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    tag = run / "global_step4"
    assert record_path(run / "global_step4") == tag / RECORD_NAME
    entry = check_checkpoint(list_run_checkpoints(run)[3], workers=0)
    write_record(tag, entry.to_dict())
    assert json.loads((tag / RECORD_NAME).read_text())["result"]["findings"] == 2
    assert load_valid_record(tag) == entry.to_dict()
    report = scan_run(run, workers=0)
    again = report.checkpoints[3]
    assert again.reused_record and again.findings == 2 and again.details == entry.details
    assert not report.checkpoints[2].reused_record
    # any file touched: the record is stale and ignored
    os.utime(tag / "mp_rank_00_model_states.pt", ns=(5, 5))
    assert load_valid_record(tag) is None
    assert not scan_run(run, workers=0).checkpoints[3].reused_record


def test_nonfinite_only_record_does_not_stand_for_a_full_scan(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    c = list_run_checkpoints(run)[0]
    write_record(c.path, check_checkpoint(c, nonfinite_only=True, workers=0).to_dict())
    assert check_checkpoint(c, nonfinite_only=True, workers=0).reused_record
    assert not check_checkpoint(c, workers=0).reused_record


@pytest.mark.parametrize("content", [b"{", b'{"format": "other"}', b"[]", b"\xff"], ids=["cut", "other", "list",
                                                                                       "bytes"])
def test_bad_record_is_ignored(tmp_path, content):
    run = copy_run(DS_RUN, tmp_path)
    (run / "global_step1" / RECORD_NAME).write_bytes(content)
    assert load_valid_record(run / "global_step1") is None
    assert scan_run(run, workers=0).checkpoints[0].status is RunStatus.CLEAN


def test_record_is_ignored_by_the_other_commands(tmp_path):
    run = copy_run(DS_RUN, tmp_path)
    tag = run / "global_step3"
    plain = [CliRunner().invoke(main, [cmd, str(tag)]) for cmd in ("info", "verify")]
    write_record(tag, {"x": 1})
    assert fingerprint(tag) == fingerprint(run / "global_step3")
    assert RECORD_NAME not in json.dumps(fingerprint(tag))
    for cmd, before in zip(("info", "verify"), plain):
        after = CliRunner().invoke(main, [cmd, str(tag)])
        assert (after.exit_code, after.output) == (before.exit_code, before.output)
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["reshard", str(tag), str(out), "--world-size", "1"])
    assert r.exit_code == 0, r.output
    assert not list(out.rglob(RECORD_NAME))
    d = CliRunner().invoke(main, ["diff", str(tag), str(DS_RUN / "run" / "global_step3")])
    assert d.exit_code == 0, d.output


def test_completeness_of_the_committed_runs():
    assert all(checkpoint_complete(c.path) for fx in RUN_FIXTURES for c in list_run_checkpoints(run_dir(fx)))


def test_trainer_checkpoint_without_trainer_state_is_incomplete(tmp_path):
    run = copy_run(HF_RUN, tmp_path)
    (run / "checkpoint-6" / "trainer_state.json").unlink()
    assert "trainer_state.json" in completeness_problem(run / "checkpoint-6")


# --------------------------------------------------------------------------------------------
# training-state health


@pytest.mark.parametrize("name", ["s0_fp16_w1_bnoverflow", "s1_fp16_w1_bnoverflow", "s2_fp16_w2_cpuforced",
                                  "s3_fp16_w2_cpuforced"])
def test_fp16_loss_scale_shown_as_recorded(name):
    t = json.loads((FIXTURES / name / "truth.json").read_text())
    report = scan(FIXTURES / name / "ckpt")
    tr = report.training
    assert tr is not None and tr.loss_scaler is not None
    assert tr.loss_scaler.scale == t["loss_scale"] and tr.skipped_steps == t["skipped_steps"]
    assert tr.global_steps == t["global_steps"]
    assert tr.loss_scaler.floor == 1.0  # DeepSpeed 0.19.8's default min_loss_scale
    staged = name.startswith("s0_")
    assert (tr.loss_scaler.hysteresis, tr.loss_scaler.hysteresis_left) == ((None, None) if staged else (2, 2))
    assert not report.health
    res = CliRunner().invoke(main, ["info", str(FIXTURES / name / "ckpt")])
    line = "training     fp16, dynamic loss scale 256 (floor 1" + ("" if staged else ", hysteresis 2 of 2 left") + \
        "), skipped steps 0 of 3 global steps"
    assert line in res.output.splitlines()


def test_bf16_run_without_skipped_steps_shows_no_training_line():
    res = CliRunner().invoke(main, ["info", str(FIXTURES / "s2_bf16_w2_2groups" / "ckpt")])
    assert "training" not in res.output


def _scaler(scale, floor=1.0, hysteresis=2, left=2, raises=True):
    return TrainingState("fp16", 100, 7, LossScaler(True, scale, floor, hysteresis, left, 1000, raises, "f"))


def test_loss_scale_at_floor_is_a_finding_naming_the_way_out():
    assert _scaler(2.0).findings() == []
    (msg,) = _scaler(1.0, left=1).findings()
    assert "sits at its floor (min_scale 1): the next overflow ends the run" in msg
    assert "Current loss scale already at minimum - cannot decrease scale anymore. Exiting run." in msg
    assert REPAIR_HINT in msg and REPAIR_HINT == "dsckpt repair CKPT OUT --loss-scale S"
    (msg,) = _scaler(1.0, hysteresis=3, left=3).findings()
    assert "2 more overflows in a row are skipped, the one after ends the run" in msg
    (msg,) = _scaler(1.0, hysteresis=None, left=None, raises=False).findings()
    assert "every later overflow is skipped at this scale" in msg


def test_state_reset_is_named():
    t = truth(RESET)
    (c,) = t["checkpoints"]
    reset = {n: s for n, s in c["all_zero_states"].items() if s}
    assert reset == {t["reset_param"]: ["exp_avg", "exp_avg_sq"]}
    report = scan(RESET / "run")
    assert not report.findings
    assert [(h.check.value, h.name) for h in report.health] == [("state_reset", "fc1.bias")]
    assert "fc1.bias: optimizer state exp_avg, exp_avg_sq all zeros" in report.health[0].message
    res = CliRunner().invoke(main, ["scan", "-q", str(RESET / "run")])
    assert res.exit_code == 1 and "  state_reset   fc1.bias: " in res.output
    # the same in every worker layout
    assert scan(RESET / "run").health == report.health


# the rescue helper's fp16 run (tests/fixtures/lossfloor, generate_lossfloor.py): its scale reaches the floor at
# step 5 and DeepSpeed ended the run on the next overflow
LOSSFLOOR = FIXTURES / "lossfloor" / "s2_fp16_w2"


def test_lossfloor_run_loss_scale_columns_and_floor_findings():
    t = truth(LOSSFLOOR)
    report = scan_run(LOSSFLOOR / "ckpt", workers=0)
    assert [e.path.name for e in report.checkpoints] == [c["tag"] for c in t["checkpoints"]]
    for e, c in zip(report.checkpoints, t["checkpoints"]):
        ls = c["loss_scaler"]
        assert (e.loss_scale, e.loss_scale_floor) == (ls["cur_scale"], ls["min_scale"])
        assert (e.skipped_steps, e.global_steps) == (c["skipped_steps"], c["global_steps"])
        floor = [d for d in e.details if d.startswith("loss_scale ")]
        assert bool(floor) is c["at_floor"]
        assert e.findings == len(c["nonfinite"]) + c["at_floor"]
        if c["at_floor"]:
            assert f"loss_scale {ls['cur_scale']:g} at its floor" in e.summary
            assert "the next overflow ends the run" in floor[0] and REPAIR_HINT in floor[0]
            assert t["exit_at_floor"]["message"] in floor[0]  # what DeepSpeed raised at the next overflow
    assert report.last_clean.path.name == t["last_clean"]
    assert report.first_with_findings.path.name == "global_step5"


def test_lossfloor_scan_and_info_of_the_floor_checkpoint():
    tag = LOSSFLOOR / "ckpt" / "global_step5"
    report = scan(tag)
    assert [h.check.value for h in report.health] == ["loss_scale"]
    assert report.training.loss_scaler.to_dict() | {"source": None} == {
        "dynamic": True, "scale": 8.0, "floor": 8.0, "hysteresis": 2, "hysteresis_left": 1, "scale_window": 1000,
        "at_floor": True, "source": None}
    assert not scan(tag, nonfinite_only=True).health  # --nonfinite: inf/NaN only
    res = CliRunner().invoke(main, ["info", str(tag)])
    assert res.exit_code == 0
    lines = res.output.splitlines()
    i = lines.index("training     fp16, dynamic loss scale 8 (floor 8, hysteresis 1 of 2 left), skipped steps 3 of 5 "
                    "global steps")
    assert lines[i + 1].startswith("             finding: loss scale 8 sits at its floor (min_scale 8): the next "
                                   "overflow ends the run")


@pytest.mark.parametrize("workers", [0, 2])
def test_scan_all_same_answer_with_any_worker_count(workers):
    a = scan_run(DS_RUN / "run", workers=workers).to_dict()
    b = scan_run(DS_RUN / "run", workers=1).to_dict()
    assert a == b


def test_a_single_checkpoint_is_a_run_of_one():
    report = scan_run(DS_RUN / "run" / "global_step2", workers=0)
    assert [e.path.name for e in report.checkpoints] == ["global_step2"]
    assert report.clean and report.first_with_findings is None
    assert report.to_dict()["first_with_findings"] is None


def test_checkpoint_deleted_while_the_run_is_read(tmp_path):
    run = copy_run(DS_RUN, tmp_path)

    def delete_step2(c):  # a cleanup (save_total_limit) removing a checkpoint after it was listed
        if c.path.name == "global_step2":
            shutil.rmtree(c.path)

    report = scan_run(run, workers=0, on_checkpoint=delete_step2)
    e = report.checkpoints[1]
    assert e.path.name == "global_step2" and e.status is RunStatus.UNREADABLE
    assert "global_step2' was deleted after the run was listed" in e.details[0]
    assert [x.status for x in report.checkpoints[2:]] == [RunStatus.CLEAN] + [RunStatus.FINDINGS] * 3
