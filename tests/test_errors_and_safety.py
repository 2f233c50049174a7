"""Bad input: unsafe pickles, truncated/missing files, wrong paths. One line, documented exit code,
no traceback, nothing executed, nothing written."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, fixtures_where, tree_digest

from dsckpt.cli import main


class _Planted:
    """Unpickling this runs code that creates a marker file (what an attacker would do)."""

    def __init__(self, marker: str) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(fx, tmp_path: Path) -> Path:
    dst = tmp_path / fx.name
    shutil.copytree(fx.ckpt, dst)
    return dst


def _tag_dir(ckpt: Path) -> Path:
    return ckpt / (ckpt / "latest").read_text().strip()


def _run(*args: str):
    return CliRunner().invoke(main, list(args))


def _assert_one_line_error(res, code: int, *phrases: str) -> None:
    assert res.exit_code == code, res.output
    assert res.stdout == ""
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("dsckpt: error: ")
    assert "Traceback" not in res.stderr
    for phrase in phrases:
        assert phrase in lines[0], lines[0]


@pytest.mark.parametrize("command", ["info", "to-fp32"])
def test_planted_code_running_pickle_is_refused_and_never_runs(tmp_path, command):
    fx = fixtures_where(stage=2, dtype="bf16")[0]
    ckpt = _copy(fx, tmp_path)
    victim = sorted(_tag_dir(ckpt).glob("*optim_states.pt"))[1]
    marker = tmp_path / "PWNED"
    real = torch.load(victim, weights_only=False)  # test-side only: build the poisoned file
    real["client_payload"] = _Planted(str(marker))
    torch.save(real, victim)
    args = [command, str(ckpt)] + ([str(tmp_path / "out.safetensors")] if command == "to-fp32" else [])
    res = _run(*args)
    _assert_one_line_error(res, 3, "refusing to unpickle global", "system", victim.name)
    assert not marker.exists(), "the planted pickle ran"
    assert not (tmp_path / "out.safetensors").exists()


def test_truncated_file_names_the_file(tmp_path):
    fx = fixtures_where(stage=3, dtype="fp32")[0]
    ckpt = _copy(fx, tmp_path)
    victim = sorted(_tag_dir(ckpt).glob("*optim_states.pt"))[0]
    data = victim.read_bytes()
    victim.write_bytes(data[: len(data) // 2])
    res = _run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors"))
    _assert_one_line_error(res, 3, victim.name, "truncated")
    assert not (tmp_path / "o.safetensors").exists()


def test_missing_rank_files_are_all_listed(tmp_path):
    fx = next(f for f in fixtures_where(stage=2) if f.meta["dp_world_size"] >= 2)
    ckpt = _copy(fx, tmp_path)
    tag_dir = _tag_dir(ckpt)
    files = sorted(tag_dir.glob("*optim_states.pt"))
    files[0].unlink()
    res = _run("info", str(ckpt))
    _assert_one_line_error(res, 3, "missing", "rank 0", "interrupted", "--tag")


def test_missing_last_rank_is_detected_from_recorded_world_size(tmp_path):
    fx = next(f for f in fixtures_where(stage=1) if f.meta["dp_world_size"] >= 3)
    ckpt = _copy(fx, tmp_path)
    files = sorted(_tag_dir(ckpt).glob("*optim_states.pt"))
    files[-1].unlink()
    res = _run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors"))
    _assert_one_line_error(res, 3, f"rank {len(files) - 1}", f"dp_world_size={len(files)}")


def test_not_a_checkpoint(tmp_path):
    (tmp_path / "empty").mkdir()
    res = _run("info", str(tmp_path / "empty"))
    _assert_one_line_error(res, 3, "is not a DeepSpeed checkpoint")


def test_garbage_file_is_reported_as_corrupt(tmp_path):
    fx = fixtures_where(stage=1, dtype="fp32", pp_size=1)[0]
    ckpt = _copy(fx, tmp_path)
    (_tag_dir(ckpt) / "mp_rank_00_model_states.pt").write_bytes(b"this is not a torch file at all")
    res = _run("info", str(ckpt))
    _assert_one_line_error(res, 3, "mp_rank_00_model_states.pt", "corrupt")


def test_unknown_tag_lists_available_tags():
    fx = fixtures_where(stage=1, dtype="fp32", pp_size=1)[0]
    res = _run("info", str(fx.ckpt), "--tag", "global_step999")
    _assert_one_line_error(res, 3, "tag 'global_step999' not found", fx.meta["tag"])


def test_stray_tensor_parallel_file_is_refused_not_misread(tmp_path):
    """A second TP rank's model-states file without its optimizer files: exit 3 naming the TP rank (the TP
    reader itself is tested in test_tensor_parallel.py)."""
    fx = fixtures_where(stage=1, dtype="fp32", pp_size=1)[0]
    ckpt = _copy(fx, tmp_path)
    tag_dir = _tag_dir(ckpt)
    shutil.copy(tag_dir / "mp_rank_00_model_states.pt", tag_dir / "mp_rank_01_model_states.pt")
    res = _run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors"))
    _assert_one_line_error(res, 3, "tensor parallelism 2", "no optimizer-state files for TP rank(s) [1]")


def test_legacy_moe_expert_files_are_refused(tmp_path):
    fx = fixtures_where(stage=0, name="s0_fp32_w1")[0]
    ckpt = _copy(fx, tmp_path)
    (_tag_dir(ckpt) / "expert_0_mp_rank_00_model_states.pt").write_bytes(b"")
    res = _run("info", str(ckpt))
    _assert_one_line_error(res, 3, "legacy Mixture-of-Experts files", "not supported")


def test_points_at_tag_folder_or_root_alike():
    fx = fixtures_where(stage=3, dtype="fp32")[0]
    a = _run("info", "--json", str(fx.ckpt))
    b = _run("info", "--json", str(fx.ckpt / fx.meta["tag"]))
    assert a.exit_code == b.exit_code == 0
    assert a.stdout == b.stdout


def test_save_dir_without_latest_and_one_tag(tmp_path):
    fx = fixtures_where(stage=1, dtype="fp32", pp_size=1)[0]
    ckpt = _copy(fx, tmp_path)
    (ckpt / "latest").unlink()
    assert _run("info", str(ckpt)).exit_code == 0


def test_hf_trainer_checkpoint_dir(tmp_path):
    """Hugging Face Trainer: checkpoint-N/ holds latest + global_stepN/ beside config and weights."""
    fx = fixtures_where(stage=2, dtype="bf16")[0]
    ckpt = tmp_path / "checkpoint-3"
    shutil.copytree(fx.ckpt, ckpt)
    (ckpt / "trainer_state.json").write_text("{}")
    res = _run("to-fp32", str(ckpt), str(tmp_path / "o.safetensors"))
    assert res.exit_code == 0, res.output


def test_input_never_modified_by_a_failed_run(tmp_path):
    fx = fixtures_where(stage=3)[0]
    before = tree_digest(fx.ckpt)
    _run("to-fp32", str(fx.ckpt), str(tmp_path / "x" / "y.safetensors"), "--max-shard-size", "1GB")
    assert tree_digest(fx.ckpt) == before


def test_help_and_to_fp32_safetensors_import_neither_torch_nor_deepspeed(tmp_path):
    """--help must start fast, and to-fp32 into safetensors runs on numpy alone (torch's import costs
    more than the conversion); reading never needs deepspeed."""
    code = (
        "import sys\n"
        "from dsckpt.cli import main\n"
        "try:\n    main(['--help'])\nexcept SystemExit:\n    pass\n"
        "assert 'torch' not in sys.modules, 'torch imported by --help'\n"
        f"try:\n    main(['to-fp32', {str(FIXTURES / 's3_bf16_w3_subgroups' / 'ckpt')!r}, "
        f"{str(tmp_path / 'o.safetensors')!r}, '-q'])\nexcept SystemExit as e:\n    assert e.code in (0, None), e.code\n"
        "assert 'torch' not in sys.modules, 'torch imported by to-fp32'\n"
        f"from safetensors.numpy import load_file\nassert len(load_file({str(tmp_path / 'o.safetensors')!r})) == 13\n"
        "assert not any(m == 'deepspeed' or m.startswith('deepspeed.') for m in sys.modules), 'deepspeed imported'\n"
        "print('OK')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().endswith("OK")
