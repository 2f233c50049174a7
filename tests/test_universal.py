"""DeepSpeed universal checkpoints: reading the folders ds_to_universal writes (info, to-fp32, scan),
writing them (reshard --universal: planned without files, compared with ds_to_universal's own output),
and loading dsckpt's output with real DeepSpeed on another rank count."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, all_fixtures, ids
from safetensors.torch import load_file

from dsckpt import safe_load
from dsckpt.cli import main
from dsckpt.errors import CorruptCheckpointError, IncompleteCheckpointError, UnsupportedCheckpointError
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.scan import scan

UNIVERSAL = FIXTURES / "universal"
UNIV = sorted(p.name for p in UNIVERSAL.iterdir() if (p / "truth.json").is_file())


def univ_meta(name: str) -> dict:
    return json.loads((UNIVERSAL / name / "truth.json").read_text())


def source(name: str):
    return next(f for f in all_fixtures() if f.name == univ_meta(name)["source_fixture"])


def test_fixtures_exist():
    assert UNIV == ["s1_bf16_w2_bf16opt", "s1_fp32_w2", "s2_bf16_w2_2groups", "s3_bf16_w3_subgroups"]


# --- reading ---------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", UNIV, ids=UNIV)
@pytest.mark.parametrize("where", ["parent", "folder"])
def test_to_fp32_equals_source_truth(name, where, tmp_path):
    """to-fp32 of DeepSpeed's own universal folder: every param, frozen param, tied alias and buffer of the
    source fixture's recorded truth, bit for bit and in its dtype, from the parent (latest_universal) or
    the folder itself."""
    meta = univ_meta(name)
    ckpt = UNIVERSAL / name / "ckpt"
    target = ckpt if where == "parent" else ckpt / meta["tag"]
    out = tmp_path / "m.safetensors"
    r = CliRunner().invoke(main, ["to-fp32", str(target), str(out), "-q"])
    assert r.exit_code == 0, r.output
    got = load_file(str(out))
    expected = source(name).expected_fp32()
    assert sorted(got) == sorted(expected)
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


@pytest.mark.parametrize("name", UNIV, ids=UNIV)
def test_reader_logical_model(name):
    meta = univ_meta(name)
    src = read_checkpoint(source(name).ckpt)
    ckpt = read_checkpoint(UNIVERSAL / name / "ckpt")
    assert ckpt.tag == meta["tag"]
    assert ckpt.layout == f"universal from zero{meta['stage']}"
    assert (ckpt.zero_stage, ckpt.dp_world_size, ckpt.precision) == (src.zero_stage, src.dp_world_size, src.precision)
    assert ckpt.optimizer_wrapper == src.optimizer_wrapper
    assert (ckpt.global_steps, ckpt.global_samples, ckpt.optimizer_step) == (3, src.global_samples, 3)
    assert [e.name for e in ckpt.entries] == [e.name for e in src.entries]
    assert ckpt.tied == {"head.weight": "embed.weight"}
    assert [e.name for e in ckpt.buffers] == ["bn.running_mean", "bn.running_var", "bn.num_batches_tracked"]
    assert sorted(e.name for e in ckpt.params if not e.trainable and e.tied_to is None) == ["frozen.bias",
                                                                                            "frozen.weight"]
    for e in ckpt.params:
        if e.trainable and e.tied_to is None:
            assert [f.file.relative_to(ckpt.tag_dir).as_posix() for p in e.pieces[:3] for f in p.fragments] == [
                f"zero/{e.name}/{s}.pt" for s in ("fp32", "exp_avg", "exp_avg_sq")]


@pytest.mark.parametrize("name", UNIV, ids=UNIV)
def test_moments_equal_source_truth(name):
    from dsckpt.assemble import read_entry
    from dsckpt.model import Role

    truth = load_file(str(source(name).dir / "truth.safetensors"))
    cache = FileCache()
    ckpt = read_checkpoint(UNIVERSAL / name / "ckpt", cache=cache)
    checked = 0
    for e in ckpt.params:
        if e.trainable and e.tied_to is None:
            for role, key in ((Role.MASTER, "param"), (Role.EXP_AVG, "exp_avg"), (Role.EXP_AVG_SQ, "exp_avg_sq")):
                assert torch.equal(read_entry(e, cache, role), truth[f"{key}/{e.name}"]), (e.name, role)
                checked += 1
    assert checked == 21


@pytest.mark.parametrize("name", UNIV, ids=UNIV)
def test_info_and_scan(name):
    meta = univ_meta(name)
    r = CliRunner().invoke(main, ["info", str(UNIVERSAL / name / "ckpt"), "--json"])
    assert r.exit_code == 0, r.output
    s = json.loads(r.output)
    assert s["tag"] == meta["tag"] and s["health"]["ok"]
    assert s["params"]["numel_trainable"] == 165 and s["params"]["numel_frozen"] == 40
    assert len(s["files"]) == len([f for f in meta["files"] if f != "latest_universal"])
    report = scan(UNIVERSAL / name / "ckpt")
    assert report.clean, [f.describe() for f in report.findings]
    assert report.stored_tensors > 20


def test_latest_wins_over_latest_universal(tmp_path):
    """ds_to_universal writes latest_universal into the original save dir: 'latest' still names the tag
    read by default, --tag picks the universal folder."""
    save = tmp_path / "save"
    shutil.copytree(FIXTURES / "s2_bf16_w2_2groups" / "ckpt", save)
    shutil.copytree(UNIVERSAL / "s2_bf16_w2_2groups" / "ckpt" / "global_step3_universal", save / "global_step3_universal")
    shutil.copy(UNIVERSAL / "s2_bf16_w2_2groups" / "ckpt" / "latest_universal", save)
    assert read_checkpoint(save).layout == "zero2"
    assert read_checkpoint(save, tag="global_step3_universal").layout == "universal from zero2"


# --- malformed universal folders (hand-made damage) -------------------------------------------------

def _copy(tmp_path: Path, name: str = "s2_bf16_w2_2groups") -> Path:
    dst = tmp_path / "u"
    shutil.copytree(UNIVERSAL / name / "ckpt", dst)
    return dst / univ_meta(name)["tag"]


def test_missing_state_files_are_listed_together(tmp_path):
    tag = _copy(tmp_path)
    (tag / "zero" / "fc1.weight" / "exp_avg.pt").unlink()
    (tag / "zero" / "bn.bias" / "step.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"missing 2 state file\(s\): zero/fc1.weight/exp_avg.pt, "
                                                        r"zero/bn.bias/step.pt"):
        read_checkpoint(tag.parent)


def test_missing_model_states_is_named(tmp_path):
    tag = _copy(tmp_path)
    (tag / "mp_rank_00_model_states.pt").unlink()
    with pytest.raises(IncompleteCheckpointError, match=r"has a universal 'zero/' folder but no "
                                                        r"mp_rank_00_model_states.pt \(ZeRO-1/2\) or"):
        read_checkpoint(tag.parent)


def test_wrong_shape_state_file(tmp_path):
    tag = _copy(tmp_path)
    torch.save({"cat_dim": 0, "param": torch.zeros(5)}, tag / "zero" / "fc2.bias" / "fp32.pt")
    with pytest.raises(CorruptCheckpointError, match=r"fc2.bias/fp32.pt: holds float32\[5\], param 'fc2.bias' of "
                                                     r"shape \[6\] needs float32\[6\]"):
        read_checkpoint(tag)


def test_tensor_parallel_keys_are_refused(tmp_path):
    tag = _copy(tmp_path)
    torch.save({"cat_dim": 0, "vocab_tensor": True, "param": torch.zeros(11, 6)}, tag / "zero" / "embed.weight" / "fp32.pt")
    with pytest.raises(UnsupportedCheckpointError, match=r"embed.weight/fp32.pt: holds \['vocab_tensor'\]"):
        read_checkpoint(tag)


def test_param_name_cannot_leave_the_folder(tmp_path):
    tag = _copy(tmp_path)
    ms = safe_load.materialize(safe_load.load(tag / "mp_rank_00_model_states.pt"))
    ms["param_shapes"][0]["../evil"] = ms["param_shapes"][0].pop("fc1.weight")
    torch.save(ms, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=r"param name '\.\./evil' cannot be a folder of 'zero/'"):
        read_checkpoint(tag)


def test_unsafe_pickle_in_state_file_is_refused(tmp_path):
    from dsckpt.errors import UnsafeCheckpointError

    tag = _copy(tmp_path)
    torch.save({"param": torch.zeros(6), "cat_dim": 0, "x": Path("a")}, tag / "zero" / "fc2.bias" / "fp32.pt")
    with pytest.raises(UnsafeCheckpointError, match="fc2.bias/fp32.pt"):
        read_checkpoint(tag)


def test_cli_error_is_one_line(tmp_path):
    tag = _copy(tmp_path)
    (tag / "zero" / "fc1.weight" / "fp32.pt").write_bytes(b"not a zip")
    r = CliRunner().invoke(main, ["to-fp32", str(tag.parent), str(tmp_path / "o.safetensors")])
    assert r.exit_code == 3
    assert r.stderr.count("\n") == 1 and "zero/fc1.weight/fp32.pt" in r.stderr
