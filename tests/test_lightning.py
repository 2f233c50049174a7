"""Lightning ``DeepSpeedStrategy`` checkpoints (issue 19): ``to-fp32 OUT.ckpt``, ``load_from_checkpoint``, resume.

The fixtures are real Lightning 2.6.6 + DeepSpeed 0.19.8 ``epoch=0-step=3.ckpt/`` folders (tests/fixtures/lightning_*,
README there). The fast tests read them in-process; the ``deepspeed`` ones start Lightning in a subprocess
(tests/lightning_check.py).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES
from ds_launch import free_port, run_in_session
from safetensors.torch import load_file

from dsckpt import safe_load, stand_ins
from dsckpt.cli import main
from dsckpt.lightning import CONVERTER_DROPPED_KEYS
from dsckpt.writers.torch_stream import write_torch_tree

REPO = Path(__file__).resolve().parent.parent
# Found by their truth files, not by importing tests/fixtures/lightning_models.py: importing lightning takes ~5 s,
# which only the subprocess tests pay.
NAMES = sorted(p.parent.name for p in FIXTURES.glob("lightning_*/lightning_truth.json"))
KNOWN_SUFFIXES = ".safetensors, .bin, .pt, .pth, .ckpt"


def _meta(name: str) -> dict:
    return json.loads((FIXTURES / name / "lightning_truth.json").read_text())


def _ckpt(name: str) -> Path:
    return FIXTURES / name / _meta(name)["ckpt"]


def _cli(*argv: str):
    return CliRunner().invoke(main, [str(a) for a in argv])


def _same(a, b) -> bool:
    """Deep equality of two loaded client states: same types, keys in the same order, tensors bit for bit."""
    if isinstance(a, torch.Tensor):
        return (isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape
                and torch.equal(a.view(-1).view(torch.uint8) if a.numel() else a, b.view(-1).view(torch.uint8)
                                if b.numel() else b))
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return type(a) is type(b) and len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return type(a) is type(b) and a == b


def _model_states(ckpt: Path) -> Path:
    """Rank 0's model-states file, the one Lightning's converter (and dsckpt's .ckpt export) reads."""
    for name in ("mp_rank_00_model_states.pt", "zero_pp_rank_0_mp_rank_00_model_states.pt"):
        if (ckpt / "checkpoint" / name).exists():
            return ckpt / "checkpoint" / name
    raise AssertionError(f"no rank-0 model-states file in {ckpt}")


def _variant(tmp_path: Path, name: str, change) -> Path:
    """A copy of fixture ``name``'s checkpoint folder whose rank-0 model-states file has ``change(tree)`` applied
    (written with dsckpt's streaming writer, which pickles stand-ins under their original class paths)."""
    dst = tmp_path / "variant" / "epoch=0-step=3.ckpt"
    shutil.copytree(_ckpt(name), dst)
    ms = _model_states(dst)
    tree = dict(safe_load.load(ms))
    change(tree)
    tmp = ms.with_suffix(".new")
    write_torch_tree(tmp, tree)
    os.replace(tmp, ms)
    return dst


def test_four_lightning_fixtures_with_converter_truth():
    assert NAMES == ["lightning_z2_bf16_w2", "lightning_z2_fp32_w2", "lightning_z3_bf16_w2", "lightning_z3_fp32_w2"]
    for name in NAMES:
        meta = _meta(name)
        assert meta["lightning_version"] == "2.6.6" and meta["ds_version"] == "0.19.8"
        assert meta["crosscheck"]["converter_state_dict_equals_fp32_masters"], name
        assert (_ckpt(name) / "latest").read_text() == "checkpoint"
        assert meta["client_state_inf"], name  # every fixture keeps at least ModelCheckpoint.kth_value = +inf


# ---------------------------------------------------------------------------------------------------------------
# to-fp32 OUT.ckpt


@pytest.mark.parametrize("name", NAMES)
def test_ckpt_export_is_what_lightnings_converter_writes(tmp_path, name):
    """Same top-level keys in the same order, every carried value equal (inf included), state_dict bit-identical to
    Lightning's converter, to the fp32 masters recorded from DeepSpeed and to dsckpt's own safetensors export."""
    out, st = tmp_path / "model.ckpt", tmp_path / "model.safetensors"
    r = _cli("to-fp32", "-q", _ckpt(name), out)
    assert r.exit_code == 0, r.output
    assert "client state from " in r.stdout and "hyper_parameters" in r.stdout
    assert _cli("to-fp32", "-q", _ckpt(name), st).exit_code == 0
    got = torch.load(out, weights_only=True)  # what Lightning's load_from_checkpoint does by default on torch >= 2.6
    want = torch.load(FIXTURES / name / "lightning_converter.ckpt", weights_only=True)
    assert list(got) == list(want)
    assert not set(got) & set(CONVERTER_DROPPED_KEYS)
    for key in want:
        if key != "state_dict":
            assert _same(got[key], want[key]), key
    # state_dict: the same names and bytes. Only the order differs (the module's; the converter puts buffers first)
    # and the converter's tensors carry requires_grad=True; load_state_dict looks at neither.
    assert sorted(got["state_dict"]) == sorted(want["state_dict"])
    for n, t in want["state_dict"].items():
        assert _same(got["state_dict"][n], t.detach()), n
    truth = load_file(FIXTURES / name / "lightning_truth.safetensors")
    flat = load_file(st)
    assert list(got["state_dict"]) == list(flat)
    for n, t in got["state_dict"].items():
        assert t.dtype == flat[n].dtype and torch.equal(t, flat[n]), n
        if f"param/{n}" in truth:
            assert torch.equal(t, truth[f"param/{n}"]), n
        else:
            assert torch.equal(t, truth[f"buffer/{n}"].to(t.dtype)), n
    assert got["hyper_parameters"] == _meta(name)["hyper_parameters"] and type(got["hyper_parameters"]) is dict
    assert got["global_step"] == 3 and got["epoch"] == 0
    assert sorted(p.name for p in tmp_path.iterdir()) == ["model.ckpt", "model.safetensors"]  # no temp files left


def test_ckpt_export_dry_run_lists_the_client_state(tmp_path):
    r = _cli("to-fp32", "--dry-run", _ckpt("lightning_z2_bf16_w2"), tmp_path / "m.ckpt")
    assert r.exit_code == 1, r.output  # --dry-run with work to do
    assert "as lightning to" in r.stdout
    assert "client state from mp_rank_00_model_states.pt:" in r.stdout and "lr_schedulers" in r.stdout
    assert not (tmp_path / "m.ckpt").exists()


def test_attribute_dict_is_read_and_written_as_a_plain_dict(tmp_path):
    """Lightning's AttributeDict is allow-listed by name (as a dict stand-in, lightning not imported): the export
    writes a plain dict, so the file still loads with weights_only=True."""
    key = ("lightning.fabric.utilities.data", "AttributeDict")
    cls = stand_ins.ATTRIBUTE_DICTS[key]

    def change(tree):
        tree["hyper_parameters"] = cls(tree["hyper_parameters"])

    ckpt = _variant(tmp_path, "lightning_z2_fp32_w2", change)
    with open(_model_states(ckpt), "rb") as f:
        assert b"lightning.fabric.utilities.data" in f.read()  # the variant really pickles Lightning's class path
    r = _cli("to-fp32", "-q", ckpt, tmp_path / "m.ckpt")
    assert r.exit_code == 0, r.output
    hp = torch.load(tmp_path / "m.ckpt", weights_only=True)["hyper_parameters"]
    assert type(hp) is dict and hp == _meta("lightning_z2_fp32_w2")["hyper_parameters"]


def test_reshard_writes_an_attribute_dict_back_under_lightnings_class_path(tmp_path):
    key = ("lightning.fabric.utilities.data", "AttributeDict")
    cls = stand_ins.ATTRIBUTE_DICTS[key]
    ckpt = _variant(tmp_path, "lightning_z3_fp32_w2", lambda t: t.update(hyper_parameters=cls(t["hyper_parameters"])))
    out = tmp_path / "resharded" / "epoch=0-step=3.ckpt"
    r = _cli("reshard", "-q", "--world-size", "1", ckpt, out)
    assert r.exit_code == 0, r.output
    hp = safe_load.load(_model_states(out))["hyper_parameters"]
    assert (type(hp).ds_module, type(hp).ds_name) == key
    assert dict(hp) == _meta("lightning_z3_fp32_w2")["hyper_parameters"]


def test_client_state_lightning_cannot_load_is_refused_and_can_be_left_out(tmp_path):
    """An argparse.Namespace (readable: Megatron-DeepSpeed stores one) in the hyper-parameters would make Lightning's
    weights_only load fail: refused with exit 3 naming the class and where it is, nothing written;
    --no-client-state writes state_dict alone."""
    ns = stand_ins.stand_in_class("argparse", "Namespace")
    assert ns is not None
    args = ns.__new__(ns)
    args.__dict__.update(lr=0.1)

    def change(tree):
        tree["hyper_parameters"] = {**tree["hyper_parameters"], "args": args}

    ckpt = _variant(tmp_path, "lightning_z3_bf16_w2", change)
    out = tmp_path / "m.ckpt"
    r = _cli("to-fp32", "-q", ckpt, out)
    assert r.exit_code == 3, r.output
    assert "argparse.Namespace at ['hyper_parameters']['args']" in r.stderr
    assert "zero_pp_rank_0_mp_rank_00_model_states.pt" in r.stderr and "--no-client-state" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    assert not out.exists() and [p.name for p in tmp_path.iterdir()] == ["variant"]
    r = _cli("to-fp32", "-q", "--no-client-state", ckpt, out)
    assert r.exit_code == 0, r.output
    got = torch.load(out, weights_only=True)
    want = torch.load(FIXTURES / "lightning_z3_bf16_w2" / "lightning_converter.ckpt", weights_only=True)
    assert list(got) == ["state_dict"] and sorted(got["state_dict"]) == sorted(want["state_dict"])
    assert all(_same(got["state_dict"][n], t.detach()) for n, t in want["state_dict"].items())


def test_a_class_outside_the_allow_list_is_refused_by_the_safe_loader(tmp_path):
    """A class the safe loader does not know (here collections.Counter) is refused while reading, for every output:
    the model-states file is one pickle, so --no-client-state cannot skip it (documented)."""
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    shutil.copytree(_ckpt("lightning_z2_bf16_w2"), ckpt)
    ms = _model_states(ckpt)
    state = torch.load(ms, weights_only=False)
    from collections import Counter

    state["hyper_parameters"]["counts"] = Counter(a=1)
    torch.save(state, ms)
    for extra in ([], ["--no-client-state"]):
        r = _cli("to-fp32", "-q", *extra, ckpt, tmp_path / "m.ckpt")
        assert r.exit_code == 3, r.output
        assert "refusing to unpickle global 'collections.Counter'" in r.stderr
    assert not (tmp_path / "m.ckpt").exists()


def test_no_client_state_is_for_ckpt_outputs_only(tmp_path):
    r = _cli("to-fp32", "--no-client-state", _ckpt("lightning_z2_fp32_w2"), tmp_path / "m.safetensors")
    assert r.exit_code == 2 and "--no-client-state is for a Lightning export" in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# OUT suffixes


@pytest.mark.parametrize("out", ["model.ckpt2", "model.foo", "weights.v2"])
def test_unknown_out_suffix_is_a_usage_error_listing_the_known_ones(tmp_path, out):
    r = _cli("to-fp32", _ckpt("lightning_z2_fp32_w2"), tmp_path / out)
    assert r.exit_code == 2, r.output
    assert f"unknown output suffix '{Path(out).suffix}'" in r.stderr and KNOWN_SUFFIXES in r.stderr
    assert r.stdout == "" and list(tmp_path.iterdir()) == []


def test_a_lightning_checkpoint_folder_as_out_is_a_usage_error_even_with_force(tmp_path):
    """The natural slip: OUT = a (copy of the) Lightning checkpoint folder itself. Refused up front, untouched."""
    ckpt = tmp_path / "epoch=0-step=3.ckpt"
    shutil.copytree(_ckpt("lightning_z2_bf16_w2"), ckpt)
    before = sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*"))
    r = _cli("to-fp32", "--force", ckpt, ckpt)
    assert r.exit_code == 2, r.output
    # the overlap check (OUT is the input) comes first; the folder-as-file check covers other folders
    assert f"output '{ckpt}' overlaps the input '{ckpt}'" in r.stderr, r.stderr
    assert sorted(p.relative_to(tmp_path) for p in tmp_path.rglob("*")) == before
    other = tmp_path / "other.ckpt"
    other.mkdir()
    r = _cli("to-fp32", "--force", ckpt, other)
    assert r.exit_code == 2 and "is a folder, and a .ckpt OUT is one file" in r.stderr, r.output
    assert "what to-fp32 reads" in r.stderr


@pytest.mark.parametrize("how", ["no suffix", "trailing slash", "existing folder"])
def test_folder_outputs_still_get_safetensors_shards(tmp_path, how):
    if how == "no suffix":
        out, arg = tmp_path / "export", str(tmp_path / "export")
    elif how == "trailing slash":
        out, arg = tmp_path / "export.v2", str(tmp_path / "export.v2") + "/"
    else:
        out = tmp_path / "export.v2"
        out.mkdir()
        arg = str(out)
    r = _cli("to-fp32", "-q", *(["--force"] if how == "existing folder" else []), _ckpt("lightning_z2_fp32_w2"), arg)
    assert r.exit_code == 0, r.output
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]


# ---------------------------------------------------------------------------------------------------------------
# Lightning itself: load_from_checkpoint, and resume after reshard


def _run(argv: list[str], *, timeout: float, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """A Lightning subprocess; its process group (ranks included) is killed on timeout."""
    return run_in_session([sys.executable, *argv], cwd=REPO, timeout=timeout, env=env)


@pytest.mark.live
@pytest.mark.deepspeed
def test_load_from_checkpoint_reads_the_export_strictly_with_lightnings_defaults(tmp_path):
    """Net.load_from_checkpoint(OUT) with no arguments (strict=True; weights_only=None, i.e. torch's True): the
    weights are the export's, the hyper-parameters the run's. The AttributeDict variant loads too."""
    pairs = []
    for name in NAMES:
        out = tmp_path / f"{name}.ckpt"
        assert _cli("to-fp32", "-q", _ckpt(name), out).exit_code == 0
        pairs.append(f"{out}={name}")
    cls = stand_ins.ATTRIBUTE_DICTS[("lightning.fabric.utilities.data", "AttributeDict")]
    ckpt = _variant(tmp_path, "lightning_z2_bf16_w2", lambda t: t.update(hyper_parameters=cls(t["hyper_parameters"])))
    out = tmp_path / "attrdict.ckpt"
    assert _cli("to-fp32", "-q", ckpt, out).exit_code == 0
    pairs.append(f"{out}=lightning_z2_bf16_w2")
    result = tmp_path / "load.json"
    proc = _run(["tests/lightning_check.py", "load", str(result), *pairs], timeout=120)
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    records = json.loads(result.read_text())
    assert len(records) == len(pairs)
    for rec in records:
        assert rec["ok"], rec
        assert rec["hparams"] == _meta(rec["fixture"])["hyper_parameters"], rec
        assert rec["weights_equal_file"] and rec["param_dtypes"] == ["torch.float32"], rec
        assert rec["names"] == sorted(_meta(rec["fixture"])["state_dict_names"]), rec


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("name", NAMES)
def test_resume_on_one_process_after_reshard(tmp_path, name):
    """dsckpt reshard 2 -> 1, then Lightning trainer.fit(model, ckpt_path=OUT) on one CPU process: DeepSpeed
    restores the saved fp32 masters, Adam moments and buffers bit for bit (compared with the truth recorded at save
    time), the Adam step and Lightning's global step continue from 3, and training runs to step 5."""
    out = tmp_path / "resumed" / "epoch=0-step=3.ckpt"
    r = _cli("reshard", "-q", "--world-size", "1", _ckpt(name), out)
    assert r.exit_code == 0, r.output
    result = tmp_path / "resume.json"
    proc = _run(["tests/lightning_check.py", "resume", str(result), name, str(out)], timeout=150,
                env={"MASTER_PORT": str(free_port())})
    assert proc.returncode == 0 and result.exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads(result.read_text())
    meta = _meta(name)
    assert rec["mismatched"] == [], rec
    assert sorted(rec["checked"]) == sorted([f"{k}/{n}" for n in meta["params"] for k in ("param", "exp_avg",
                                                                                          "exp_avg_sq")]
                                            + [f"buffer/{n}" for n in meta["buffers"]])
    assert rec["global_step_at_start"] == 3 and rec["global_step_at_end"] == 5
    assert rec["optimizer_step"] == [3.0]
    assert sorted(rec["losses"]) == ["4", "5"] and rec["losses_finite"]
    # Step 4's batch is the first global batch again (samples 0-3). Its loss is compared with a reference computed in
    # the same check process from the saved weights (tests/fixtures/lightning_models.first_batch_loss), so both come
    # from this machine's kernels: equal here, and 2e-3 leaves room for a last-bit difference of one bf16 logit
    # between the engine's forward and the plain module's (a bf16 ulp is 7.8e-3 at 1.0, averaged over 4 samples).
    # Swapping one of the 4 samples moves the loss by 1.9e-2 or more (bf16 fixtures), so a wrong batch still fails.
    assert rec["losses"]["4"] == pytest.approx(rec["reference_loss"], abs=2e-3, rel=0)
    # the value the generator recorded on the machine that made the fixture: the same up to another CPU's rounding
    assert rec["reference_loss"] == pytest.approx(meta["next_loss"], rel=1e-2 if meta["precision"] == "bf16-mixed"
                                                  else 1e-5)
    if meta["spec"]["scheduler"]:
        (sched,) = rec["lr_scheduler"]
        assert sched["_last_lr"] == [0.005]  # restored from the carried client state (a new scheduler: 0.01)
    if meta["spec"]["monitored"]:
        # restored from the carried client state (a new ModelCheckpoint has ""); kth_value / best_score are +inf in
        # the file and in a new callback alike, so they prove nothing here
        assert rec["callbacks"]["ModelCheckpoint"]["best_model_path"].endswith("/ckpts/epoch=0-step=3.ckpt")


def test_ckpt_export_through_the_whole_tensor_path_is_the_same(tmp_path, monkeypatch):
    """Tensors whose fragments cannot be streamed in chunks (strided or out of order) are produced whole, through
    torch; forced here for every tensor, the .ckpt file is the same."""
    from dsckpt import convert

    ckpt = _ckpt("lightning_z2_bf16_w2")
    assert _cli("to-fp32", "-q", "--dtype", "bf16", ckpt, tmp_path / "a.ckpt").exit_code == 0
    monkeypatch.setattr(convert, "plan_piece_chunks", lambda *a, **k: None)
    assert _cli("to-fp32", "-q", "--dtype", "bf16", ckpt, tmp_path / "b.ckpt").exit_code == 0
    a, b = (torch.load(tmp_path / f"{x}.ckpt", weights_only=True) for x in "ab")
    assert _same(a, b) and {t.dtype for t in a["state_dict"].values()} == {torch.bfloat16}
