"""Run folders (issue 19): CKPT may be a Hugging Face Trainer ``output_dir`` (the newest ``checkpoint-N`` by
N, as ``transformers.trainer_utils.get_last_checkpoint``) or a Lightning ``dirpath`` (``last.ckpt``, else
the only ``*.ckpt``, else exit 2 listing them). Run folders are built in tmp_path from copies of real
DeepSpeed fixtures."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from click.testing import CliRunner
from conftest import FIXTURES, all_fixtures, tree_digest

from dsckpt.cli import main
from dsckpt.errors import UsageError
from dsckpt.layout import RunFolderKind, choose_in_run_folder, find_tag_dir, resolve_run_folder
from dsckpt.scan import scan

FX = {f.name: f for f in all_fixtures()}
HF = FX["hf_llama_z2_bf16_w2"]  # a real Trainer checkpoint-3/ (config.json, trainer_state.json, rng states ...)
OTHER = FX["s1_fp32_w2"]  # another run, to tell which one was used


def test_choose_newest_hf_checkpoint_by_number_not_name():
    c = choose_in_run_folder(Path("out"), ["checkpoint-9", "checkpoint-10", "checkpoint-3", "runs",
                                           "checkpoint-11-tmp", "checkpoint-x"])
    assert c is not None and c.kind is RunFolderKind.HF_OUTPUT_DIR
    assert c.checkpoint == Path("out/checkpoint-10")
    assert c.candidates == ("checkpoint-3", "checkpoint-9", "checkpoint-10")


@pytest.mark.parametrize("names,chosen", [
    (["epoch=0-step=3.ckpt"], "epoch=0-step=3.ckpt"),
    (["epoch=0-step=3.ckpt", "epoch=1-step=6.ckpt", "last.ckpt"], "last.ckpt"),
], ids=["only-one", "last-wins"])
def test_choose_lightning_checkpoint(names, chosen):
    c = choose_in_run_folder(Path("d"), names)
    assert c is not None and c.kind is RunFolderKind.LIGHTNING_DIRPATH and c.checkpoint == Path("d") / chosen


def test_choose_several_lightning_checkpoints_is_a_usage_error_listing_them():
    with pytest.raises(UsageError, match=r"holds 2 Lightning checkpoints and no last.ckpt: "
                                         r"epoch=0-step=3.ckpt, epoch=1-step=6.ckpt; point dsckpt at one"):
        choose_in_run_folder(Path("d"), ["epoch=1-step=6.ckpt", "epoch=0-step=3.ckpt"])


def test_choose_nothing_in_other_folders():
    assert choose_in_run_folder(Path("d"), ["logs", "global_step3"]) is None


def _hf_output_dir(tmp_path: Path) -> Path:
    out = tmp_path / "output"
    shutil.copytree(OTHER.ckpt, out / "checkpoint-3")
    shutil.copytree(HF.ckpt, out / "checkpoint-10")
    (out / "checkpoint-99").write_text("a file, not a checkpoint directory")  # get_last_checkpoint skips files
    (out / "runs").mkdir()
    return out


def _lightning_ckpt(dirpath: Path, name: str, fx) -> Path:
    """``dirpath/NAME`` as Lightning's DeepSpeedStrategy writes it: ``latest`` = "checkpoint", ``checkpoint/``."""
    folder = dirpath / name
    folder.mkdir(parents=True)
    tag_dir = fx.ckpt / (fx.ckpt / "latest").read_text()
    shutil.copytree(tag_dir, folder / "checkpoint")
    (folder / "latest").write_text("checkpoint")
    return folder


def test_resolve_is_none_for_a_checkpoint_itself(tmp_path):
    out = _hf_output_dir(tmp_path)
    assert resolve_run_folder(out / "checkpoint-10") is None  # holds latest
    assert resolve_run_folder(out / "checkpoint-10" / "global_step3") is None  # a tag folder
    assert resolve_run_folder(out / "runs") is None
    assert resolve_run_folder(out).checkpoint == out / "checkpoint-10"
    assert find_tag_dir(out)[0] == out / "checkpoint-10"  # every reader resolves it too
    assert scan(out).clean


def test_every_read_command_accepts_an_hf_output_dir(tmp_path):
    out = _hf_output_dir(tmp_path)
    note = (f"dsckpt: using {out / 'checkpoint-10'} (the newest checkpoint-N, N=10 in Hugging Face Trainer "
            f"output_dir '{out}')\n")
    run = {"folder": str(out), "checkpoint": str(out / "checkpoint-10"), "kind": "Hugging Face Trainer output_dir",
           "rule": "the newest checkpoint-N, N=10", "candidates": ["checkpoint-3", "checkpoint-10"]}
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0, r.output
    assert r.stderr == note
    assert r.stdout.startswith(f"checkpoint   {out / 'checkpoint-10'}\n") and "hf trainer" in r.stdout
    for argv in (["info", str(out), "--json"], ["scan", str(out), "--json", "-q"], ["verify", str(out), "--json"]):
        r = CliRunner().invoke(main, argv)
        assert r.exit_code == 0, (argv, r.output)
        assert r.stderr == note
        assert json.loads(r.stdout)["run_folder"] == run
    r = CliRunner().invoke(main, ["diff", str(out), str(out / "checkpoint-10"), "--json", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["run_folder_a"] == run and doc["run_folder_b"] is None
    r = CliRunner().invoke(main, ["repair", str(out), str(tmp_path / "fixed"), "--from", "master", "--json"])
    assert r.exit_code == 0 and json.loads(r.stdout)["run_folder"] == run


def test_writing_commands_accept_an_hf_output_dir(tmp_path):
    out = _hf_output_dir(tmp_path)
    r = CliRunner().invoke(main, ["to-fp32", str(out), str(tmp_path / "model.safetensors"), "-q"])
    assert r.exit_code == 0, r.output
    assert "checkpoint-10" in r.stderr
    same = CliRunner().invoke(main, ["diff", str(tmp_path / "model.safetensors"), str(HF.ckpt), "-q"])
    assert same.exit_code == 0, same.output
    r = CliRunner().invoke(main, ["reshard", str(out), str(tmp_path / "one"), "-n", "1", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert f"using {out / 'checkpoint-10'}" in r.stderr
    assert "trainer_state.json" in r.stdout  # the Trainer files of checkpoint-10 are carried


def test_lightning_dirpath_last_ckpt_wins_else_ambiguous_exit_2(tmp_path):
    dirpath = tmp_path / "checkpoints"
    _lightning_ckpt(dirpath, "epoch=0-step=3.ckpt", OTHER)
    r = CliRunner().invoke(main, ["info", str(dirpath)])
    assert r.exit_code == 0, r.output
    assert r.stderr == (f"dsckpt: using {dirpath / 'epoch=0-step=3.ckpt'} (the only *.ckpt checkpoint in Lightning "
                        f"ModelCheckpoint dirpath '{dirpath}')\n")
    assert "tag          checkpoint" in r.stdout
    _lightning_ckpt(dirpath, "epoch=1-step=6.ckpt", OTHER)
    r = CliRunner().invoke(main, ["scan", str(dirpath)])
    assert r.exit_code == 2 and r.stdout == ""
    assert r.stderr == (f"dsckpt: error: '{dirpath}' holds 2 Lightning checkpoints and no last.ckpt: "
                        "epoch=0-step=3.ckpt, epoch=1-step=6.ckpt; point dsckpt at one of them\n")
    _lightning_ckpt(dirpath, "last.ckpt", FX["s2_bf16_w2_clientstate"])
    r = CliRunner().invoke(main, ["scan", str(dirpath), "--nonfinite", "--json", "-q"])
    assert r.exit_code == 0, r.output
    doc = json.loads(r.stdout)
    assert doc["run_folder"]["checkpoint"] == str(dirpath / "last.ckpt") and doc["run_folder"]["rule"] == "last.ckpt"
    assert len(doc["client_state_nonfinite"]) == 4


def test_a_folder_that_is_neither_is_still_not_a_checkpoint(tmp_path):
    (tmp_path / "logs").mkdir()
    r = CliRunner().invoke(main, ["info", str(tmp_path)])
    assert r.exit_code == 3 and "is not a DeepSpeed checkpoint" in r.stderr


@pytest.mark.parametrize("where", ["run_folder", "checkpoint", "inside_checkpoint", "tag_folder"])
def test_to_fp32_refuses_an_output_that_overlaps_the_input(tmp_path, where):
    """With --force the old OUT is moved aside and deleted: an OUT that is the checkpoint, lies inside it, or holds it
    (the run folder a user points at) would delete the input. Refused (exit 2) before anything is written."""
    run = tmp_path / "output"
    for n in (4, 8):
        shutil.copytree(FIXTURES / "hf_llama_z2_bf16_w2" / "ckpt", run / f"checkpoint-{n}")
    before = tree_digest(run)
    out = {"run_folder": run, "checkpoint": run / "checkpoint-8", "inside_checkpoint": run / "checkpoint-8" / "m.safetensors",
           "tag_folder": run / "checkpoint-8" / "global_step3"}[where]
    res = CliRunner().invoke(main, ["to-fp32", "-q", "--force", str(run), str(out)])
    assert res.exit_code == 2, res.output
    assert f"output '{out}' overlaps the input '{run / 'checkpoint-8'}'" in res.stderr
    assert tree_digest(run) == before
