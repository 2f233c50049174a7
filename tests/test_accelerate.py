"""Accelerate ``save_state`` folders (issue 19): ``reshard`` carries Accelerate's files (scheduler, custom
objects, RNG states by the rank rule) byte for byte, and ``accelerator.load_state(OUT)`` resumes on the new
process count. The fixture ``accelerate_s2_bf16_w2`` was written by Accelerate 1.15 + DeepSpeed 0.19.8 on 2 CPU
ranks (``tests/fixtures/generate_accelerate.py``)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES
from ds_launch import DEEPSPEED, run_deepspeed

from dsckpt import safe_load
from dsckpt.cli import main
from dsckpt.hf import FileRole, is_accelerate_folder, is_hf_folder, plan_resume_files

STATE = FIXTURES / "accelerate_s2_bf16_w2" / "state"
RECORD = json.loads((FIXTURES / "accelerate_s2_bf16_w2" / "record.json").read_text())
CARRIED = ("custom_checkpoint_0.pkl", "scheduler.bin")


def test_fixture_is_what_accelerate_save_state_writes_under_deepspeed():
    assert RECORD["world_size"] == 2 and RECORD["accelerate_version"] == "1.15.0"
    assert (STATE / "latest").read_text() == "pytorch_model"
    assert sorted(p.name for p in STATE.iterdir()) == [
        "custom_checkpoint_0.pkl", "latest", "pytorch_model", "random_states_0.pkl", "random_states_1.pkl",
        "scheduler.bin", "zero_to_fp32.py", "zero_to_torch.py"]
    assert is_accelerate_folder(STATE) and not is_hf_folder(STATE)


@pytest.mark.parametrize("world_size,rng,left_out", [
    (1, ["random_states_0.pkl"], ["random_states_1.pkl: rank 1 does not exist with 1 process(es)"]),
    (2, ["random_states_0.pkl", "random_states_1.pkl"], []),
    (3, ["random_states_0.pkl", "random_states_1.pkl"],
     [": rank 2 had no RNG state: no random_states_2.pkl, so Accelerate's load_state logs \"Could not load random "
      "states\" and keeps that process's RNG"]),
], ids=["2-to-1", "2-to-2", "2-to-3"])
def test_resume_plan_carries_accelerate_files_and_maps_rng_by_rank(world_size, rng, left_out):
    plan = plan_resume_files(STATE, world_size, tag="pytorch_model", tag_dirs=frozenset({"pytorch_model"}))
    assert plan is not None and plan.client == "Accelerate"
    assert [(c.source.name, c.dest_name) for c in plan.copies if c.role is not FileRole.RNG] == [
        (n, n) for n in CARRIED]
    # new rank r gets old rank r's file; unlike the Trainer, one process reads random_states_0.pkl
    assert [(c.source.name, c.dest_name) for c in plan.copies if c.role is FileRole.RNG] == [(n, n) for n in rng]
    assert [f"{o.source.name if o.source else ''}: {o.reason}" for o in plan.left_out] == left_out


def test_reshard_carries_accelerate_files_byte_for_byte(tmp_path):
    out = tmp_path / "state-1proc"
    dry = CliRunner().invoke(main, ["reshard", str(STATE), str(out), "-n", "1", "--dry-run"])
    assert dry.exit_code == 1, dry.output
    assert f"Accelerate files from {STATE} (byte for byte):" in dry.stdout
    assert "  leave out random_states_1.pkl: rank 1 does not exist with 1 process(es)" in dry.stdout
    r = CliRunner().invoke(main, ["reshard", str(STATE), str(out), "-n", "1", "-q"])
    assert r.exit_code == 0, r.output
    assert f"copied 3 Accelerate file(s) from {STATE}: custom_checkpoint_0.pkl, scheduler.bin, " \
           "random_states_0.pkl" in r.stdout
    assert sorted(p.name for p in out.iterdir()) == [
        "custom_checkpoint_0.pkl", "latest", "pytorch_model", "random_states_0.pkl", "scheduler.bin",
        "zero_to_fp32.py", "zero_to_torch.py"]
    for name in (*CARRIED, "random_states_0.pkl"):
        assert (out / name).read_bytes() == (STATE / name).read_bytes(), name
    assert (out / "latest").read_text() == "pytorch_model"
    assert sorted(p.name for p in (out / "pytorch_model").iterdir()) == [
        "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt", "mp_rank_00_model_states.pt"]
    bare = CliRunner().invoke(main, ["reshard", str(STATE), str(tmp_path / "bare"), "-n", "1", "-q", "--no-hf-files"])
    assert bare.exit_code == 0 and not (tmp_path / "bare" / "scheduler.bin").exists()


def test_accelerate_files_are_never_unpickled_by_reshard(tmp_path, monkeypatch):
    """scheduler.bin / custom_checkpoint_*.pkl / random_states_*.pkl are copied, not loaded: the safe loader
    never sees them (random_states_*.pkl holds numpy RNG state, a pickled tuple)."""
    seen: list[str] = []
    real = safe_load.load_with_info  # what load() and the readers' file cache call

    def spy(path, *a, **k):
        seen.append(Path(path).name)
        return real(path, *a, **k)

    monkeypatch.setattr(safe_load, "load_with_info", spy)
    r = CliRunner().invoke(main, ["reshard", str(STATE), str(tmp_path / "o"), "-n", "3", "-q", "--verify", "none"])
    assert r.exit_code == 0, r.output
    assert seen and not [n for n in seen if not n.endswith(".pt")]


@pytest.mark.live
@pytest.mark.deepspeed
def test_accelerate_load_state_resumes_the_resharded_folder_on_one_process(tmp_path):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    out = tmp_path / "state-1proc"
    r = CliRunner().invoke(main, ["reshard", str(STATE), str(out), "-n", "1", "-q"])
    assert r.exit_code == 0, r.output
    result = tmp_path / "result.json"
    proc = run_deepspeed("fixtures/generate_accelerate.py", ["--resume", str(out), "--result", str(result)],
                         world=1, cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    (rank0,) = json.loads(result.read_text())
    # fp32 masters and Adam moments bit for bit, global step, scheduler, custom object: checked in the script
    assert rank0["problems"] == [] and rank0["world"] == 1
    assert rank0["rng"] == "restored"  # old rank 0's random_states_0.pkl
    assert rank0["global_steps_after"] == RECORD["global_steps"] + 2  # and training goes on
