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
from conftest import FIXTURES, all_fixtures, assert_no_fsync_writes_the_same_bytes
from safetensors.torch import load_file
from scan_helpers import read_copy

from dsckpt import parsed_tree, safe_load
from dsckpt.cli import main
from dsckpt.errors import (
    CorruptCheckpointError,
    IncompleteCheckpointError,
    UnsupportedCheckpointError,
)
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
    from dsckpt.model import Role

    truth = load_file(str(source(name).dir / "truth.safetensors"))
    cache = FileCache()
    ckpt = read_checkpoint(UNIVERSAL / name / "ckpt", cache=cache)
    checked = 0
    for e in ckpt.params:
        if e.trainable and e.tied_to is None:
            for role, key in ((Role.MASTER, "param"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
                assert torch.equal(read_copy(e, cache, role), truth[f"{key}/{e.name}"]), (e.name, role)
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
    r = CliRunner().invoke(main, ["verify", str(UNIVERSAL / name / "ckpt")])
    assert r.exit_code == 0, r.output
    r = CliRunner().invoke(main, ["diff", str(UNIVERSAL / name / "ckpt"), str(source(name).ckpt), "--role", "all"])
    assert r.exit_code == 0 and " 0 different, only in A: 0, only in B: 0" in r.stdout, r.output


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
    ms = parsed_tree.materialize(safe_load.load(tag / "mp_rank_00_model_states.pt"))
    ms["param_shapes"][0]["../evil"] = ms["param_shapes"][0].pop("fc1.weight")
    torch.save(ms, tag / "mp_rank_00_model_states.pt")
    with pytest.raises(CorruptCheckpointError, match=r"param name '\.\./evil' cannot be a folder of 'zero/'"):
        read_checkpoint(tag)


def test_unsafe_pickle_in_state_file_is_refused(tmp_path):
    from fractions import Fraction

    from dsckpt.errors import UnsafeCheckpointError

    tag = _copy(tmp_path)
    torch.save({"param": torch.zeros(6), "cat_dim": 0, "x": Fraction(1, 3)}, tag / "zero" / "fc2.bias" / "fp32.pt")
    with pytest.raises(UnsafeCheckpointError, match="fc2.bias/fp32.pt"):
        read_checkpoint(tag)


def test_cli_error_is_one_line(tmp_path):
    tag = _copy(tmp_path)
    (tag / "zero" / "fc1.weight" / "fp32.pt").write_bytes(b"not a zip")
    r = CliRunner().invoke(main, ["to-fp32", str(tag.parent), str(tmp_path / "o.safetensors")])
    assert r.exit_code == 3
    assert r.stderr.count("\n") == 1 and "zero/fc1.weight/fp32.pt" in r.stderr


# --- writing ---------------------------------------------------------------------------------------

def write_universal(src: Path, out: Path, verify: str = "full", fsync: bool = True, tied_keys=None):
    from dsckpt.reshard import plan_universal_reshard, read_source_facts, run_universal

    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache, tied_keys=tied_keys)
    plan = plan_universal_reshard(ckpt, read_source_facts(ckpt, cache))
    return plan, run_universal(plan, out, cache=cache, verify=verify, fsync=fsync)


def _same(a, b, where):
    if torch.is_tensor(a) or torch.is_tensor(b):
        assert torch.is_tensor(a) and torch.is_tensor(b), where
        assert (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(a.detach(), b.detach()), where
        assert dict(getattr(a, "__dict__", {})) == dict(getattr(b, "__dict__", {})), where
    elif isinstance(a, dict):
        assert list(a) == list(b), (where, list(a), list(b))
        for k in a:
            _same(a[k], b[k], [*where, k])
    elif isinstance(a, (list, tuple)):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, [*where, i])
    elif hasattr(a, "__dict__") and not isinstance(a, type):
        assert type(a) is type(b) and vars(a) == vars(b), where
    else:
        assert type(a) is type(b) and a == b, (where, a, b)


@pytest.mark.parametrize("name", UNIV, ids=UNIV)
def test_written_folder_equals_ds_to_universal(name, tmp_path):
    """dsckpt's folder against DeepSpeed's own for the same source: the same files, and in each the same
    keys (in order), dtypes, shapes, values, tensor attributes and objects (torch.load, test side only)."""
    from conftest import tree_digest

    src = source(name)
    before = tree_digest(src.ckpt)
    plan, result = write_universal(src.ckpt, tmp_path / "out")
    assert tree_digest(src.ckpt) == before
    ds = UNIVERSAL / name / "ckpt"
    ds_files = sorted(p.relative_to(ds).as_posix() for p in ds.rglob("*") if p.is_file())
    ours = sorted(p.relative_to(tmp_path / "out").as_posix() for p in (tmp_path / "out").rglob("*") if p.is_file())
    assert ours == ds_files
    assert (tmp_path / "out" / "latest_universal").read_text() == univ_meta(name)["tag"]
    for rel in ds_files:
        if rel.endswith(".pt"):
            _same(torch.load(ds / rel, weights_only=False), torch.load(tmp_path / "out" / rel, weights_only=False), [rel])
    assert result.verified_tensors == (26 if plan.zero3 else 33)


@pytest.mark.parametrize("name", UNIV, ids=UNIV)
def test_written_folder_to_fp32_is_complete(name, tmp_path):
    write_universal(source(name).ckpt, tmp_path / "out", verify="quick")
    r = CliRunner().invoke(main, ["to-fp32", str(tmp_path / "out"), str(tmp_path / "m.safetensors"), "-q"])
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "m.safetensors"))
    expected = source(name).expected_fp32()
    assert sorted(got) == sorted(expected)  # buffers and frozen params included
    for k, t in expected.items():
        assert got[k].dtype == t.dtype and torch.equal(got[k], t), k


def test_cli_reshard_universal(tmp_path):
    src = FIXTURES / "s2_bf16_w2_2groups" / "ckpt"
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.stderr
    assert r.stdout.splitlines()[0] == (
        f"wrote universal checkpoint of {src}/global_step3 (2 ranks, ZeRO stage 2): 36 files to {tmp_path}/u/"
        "global_step3_universal, latest_universal, verified 33 tensors against the input (quick)")
    assert '"checkpoint": {"load_universal": true} and ZeRO stage 1 or 2' in r.stdout
    assert r.stderr == ""
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 2 and "exists" in r.stderr
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "v"), "--universal", "--dry-run"])
    assert r.exit_code == 1 and "zero/fc1.weight/fp32.pt: float32[7, 6] from" in r.stdout
    assert not (tmp_path / "v").exists()
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "w"), "--universal", "-n", "3"])
    assert r.exit_code == 2 and "drop --world-size" in r.stderr
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "w")])
    assert r.exit_code == 2 and "missing option '--world-size'" in r.stderr


def test_cli_reshard_universal_no_fsync_writes_the_same_files_without_fsync(tmp_path, monkeypatch):
    src = FIXTURES / "s2_bf16_w2_2groups" / "ckpt"
    assert_no_fsync_writes_the_same_bytes(tmp_path, monkeypatch, ["reshard", str(src), "--universal"])


@pytest.mark.parametrize("fixture, why", [
    ("moe_s2_bf16_w2_ep2", "Mixture-of-Experts"),
    ("moe_s0_fp32_w2_ep2", "Mixture-of-Experts"),
])
def test_universal_refusals(fixture, why, tmp_path):
    r = CliRunner().invoke(main, ["reshard", str(FIXTURES / fixture / "ckpt"), str(tmp_path / "u"), "--universal"])
    assert r.exit_code == 3, r.output
    assert why in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "u").exists()


# Stage-0 sources (ds_to_universal reads none): dense fp32 (the module is the master) and bf16
# (FP16_UnfusedOptimizer, 0.19.8 and the ds0189 set), AutoTP at fp32 and bf16, a bf16 pipeline (BF16_Optimizer files,
# model states without param_shapes), DeepSpeed's own fp32 pipeline save (its tied module's key given: --tied-key), and
# a fused FP16_Optimizer (FusedAdam, its step a Python int: step.pt holds the int, as ds_to_universal's would)
STAGE0_SOURCES = ["s0_fp32_w1", "s0_bf16_w2", "ds0189_s0_bf16_w2", "autotp/autotp_z0_fp32_tp2_dp2",
                  "autotp/autotp_z0_bf16_tp2_dp1_kv6", "pp2_dp2_bf16_z0", "pp2_fp32_z0", "s0_fp16_w1_fused"]
STAGE0_TIED_KEYS = {"pp2_fp32_z0": {0: "embed"}}


@pytest.mark.parametrize("name", STAGE0_SOURCES, ids=lambda n: n.split("/")[-1])
def test_stage0_source_universal_holds_the_recorded_truth(name, tmp_path):
    """--universal of a stage-0 save: every trainable param's zero/<name>/{fp32,exp_avg,exp_avg_sq}.pt is the
    recorded fp32 master and Adam moments (full, TP slices merged), its step.pt the recorded step; the folder read
    back by dsckpt gives the same masters, moments, step and global steps, as a ZeRO-1 universal folder."""
    from dsckpt.assemble import read_entry
    from dsckpt.model import Role

    fx = FIXTURES / name
    meta = json.loads((fx / "truth.json").read_text())
    truth = load_file(str(fx / "truth.safetensors"))
    step = (meta.get("optimizer_step") or meta.get("adam_step"))[0]
    plan, result = write_universal(fx / "ckpt", tmp_path / "out", verify="quick", fsync=False,
                                   tied_keys=STAGE0_TIED_KEYS.get(name))
    assert plan.zero_layout is not None and result.verified_tensors > 0
    zero = tmp_path / "out" / f"{meta['tag']}_universal" / "zero"
    trained = sorted(n for k in truth if k.startswith("exp_avg/")  # a tied alias's state is its source's
                     for n in (k.split("/", 1)[1],) if n not in meta.get("tied", {}))
    assert sorted(p.parent.name for p in zero.glob("*/exp_avg.pt")) == trained
    for n in trained:
        for key, fname in (("param", "fp32"), ("exp_avg", "exp_avg"), ("exp_avg_sq", "exp_avg_sq")):
            got = torch.load(zero / n / f"{fname}.pt", weights_only=False)["param"]
            assert got.dtype == torch.float32 and torch.equal(got, truth[f"{key}/{n}"].float()), (n, key)
        saved = torch.load(zero / n / "step.pt", weights_only=True)
        assert type(saved) is (int if "fused" in name else torch.Tensor) and saved == step, (n, saved)
    cache = FileCache()
    back = read_checkpoint(tmp_path / "out", cache=cache)
    assert (back.layout, back.optimizer_step, back.global_steps) == ("universal from zero1", step, meta["global_steps"])
    by_name = {e.name: e for e in back.entries}
    for n in trained:
        e = by_name[n]
        assert torch.equal(read_entry(e, cache, role=Role.MASTER), truth[f"param/{n}"].float()), n
        for key in ("exp_avg", "exp_avg_sq"):
            assert torch.equal(read_entry(e, cache, state=key), truth[f"{key}/{n}"].float()), (n, key)


def test_stage0_source_needs_its_zero1_layout():
    """A stage-0 source's universal target is written from its ZeRO-1 files (resolve_universal decides it); a target
    that is not is refused by UNIVERSAL_RULES' first row."""
    import dataclasses

    from dsckpt.ds_writers.source import describe_source
    from dsckpt.ds_writers.target import refuse_universal, resolve_universal

    ckpt = read_checkpoint(FIXTURES / "s0_fp32_w1" / "ckpt")
    src = describe_source(ckpt, refuse=False)
    target = resolve_universal(src)
    assert target.from_zero1 and target.source_stage == 0 and target.zero1_world_size == 1
    with pytest.raises(UnsupportedCheckpointError, match="ZeRO stage 0 without the ZeRO-1 layout it is written from"):
        refuse_universal(src, dataclasses.replace(target, from_zero1=False))


@pytest.mark.parametrize("name, world", [("s0_bf16_w2", 2), ("autotp/autotp_z0_fp32_tp2_dp2", 4)],
                         ids=["s0_bf16_w2", "autotp_z0_fp32_tp2_dp2"])
def test_stage0_source_universal_is_that_of_its_zero1_files(name, world, tmp_path):
    """A stage-0 save's universal folder is, file for file and value for value, the one written from its ZeRO-1
    files (reshard --zero-stage 1 at the same size), whose folders equal ds_to_universal's
    (test_written_folder_equals_ds_to_universal): zero/optimizer_state.pt holds the ZeRO-1 optimizer dict (loss
    scaler, zero_stage, partition counts, param_groups) and the model states name the params (param_shapes)."""
    src = FIXTURES / name / "ckpt"
    write_universal(src, tmp_path / "direct", verify="none", fsync=False)
    r = CliRunner().invoke(main, ["reshard", str(src), str(tmp_path / "z1"), "-n", str(world), "--zero-stage", "1",
                                  "-q", "--no-verify", "--no-fsync"])
    assert r.exit_code == 0, r.output
    write_universal(tmp_path / "z1", tmp_path / "via", verify="none", fsync=False)
    direct, via = tmp_path / "direct", tmp_path / "via"
    files = sorted(p.relative_to(via).as_posix() for p in via.rglob("*") if p.is_file())
    assert sorted(p.relative_to(direct).as_posix() for p in direct.rglob("*") if p.is_file()) == files
    for rel in files:
        if rel.endswith(".pt"):
            _same(torch.load(via / rel, weights_only=False), torch.load(direct / rel, weights_only=False), [rel])
    opt = torch.load(next(direct.glob("*/zero/optimizer_state.pt")), weights_only=False)
    assert opt["zero_stage"] == 1 and "base_optimizer_state" not in opt and opt["param_groups"]


def test_universal_source_zero3_sub_group_size_recorded_in_every_file(tmp_path):
    """A ZeRO-3 universal folder written as ZeRO-3 at another --sub-group-size: every written file's ds_config
    records the target's sub_group_size (the model-states files copied from the folder said the source's while the
    optimizer files said the target's, and verification refused the output: "ds_config: files disagree")."""
    r = CliRunner().invoke(main, ["reshard", str(UNIVERSAL / "s3_bf16_w3_subgroups" / "ckpt"), str(tmp_path / "o"),
                                  "-n", "3", "--zero-stage", "3", "--sub-group-size", "40", "--no-fsync"])
    assert r.exit_code == 0, r.output
    files = sorted((tmp_path / "o").glob("*/*_states.pt"))
    assert len(files) == 6
    for f in files:
        assert torch.load(f, weights_only=False)["ds_config"]["zero_optimization"]["sub_group_size"] == 40, f.name


def test_universal_source_to_universal_is_refused(tmp_path):
    r = CliRunner().invoke(main, ["reshard", str(UNIVERSAL / "s1_fp32_w2" / "ckpt"), str(tmp_path / "u"),
                                  "--universal"])
    assert r.exit_code == 3, r.output
    assert "found a universal checkpoint already" in r.stderr


@pytest.mark.parametrize("name", UNIV)
@pytest.mark.parametrize("world,stage", [(3, None), (1, 3), (2, 1), (2, 0)])
def test_universal_source_written_as_zero_files(name, world, stage, tmp_path):
    """A universal folder as reshard input: native ZeRO files for any world size and stage (stage 0 too: the
    optimizer's scalars from zero/optimizer_state.pt), holding the truth recorded for the run it was converted from
    (masters, moments, module copies, frozen params, buffers)."""
    from dsckpt.assemble import iter_tensors
    from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

    fx = next(f for f in all_fixtures() if f.name == name)
    cache = FileCache()
    ckpt = read_checkpoint(UNIVERSAL / name / "ckpt", cache=cache)
    plan = plan_reshard(ckpt, world, zero_stage=stage, facts=read_source_facts(ckpt, cache))
    run_reshard(plan, tmp_path / "out", cache=cache, verify="full")
    back = read_checkpoint(tmp_path / "out")
    assert not back.layout.startswith("universal") and back.dp_world_size == world
    assert back.zero_stage == (fx.meta["stage"] if stage is None else stage) and back.optimizer_step == int(fx.meta["optimizer_step"][0])
    expected = fx.expected_fp32()
    got = dict(iter_tensors(back))
    assert sorted(got) == sorted(expected)
    for n, t in got.items():
        assert torch.equal(t, expected[n]), n


# --- planning without files -----------------------------------------------------------------------

def _logical(stage: int):
    """A hand-made logical checkpoint: one group, 'w' [2, 3] split over two ranks at element 4, frozen 'f',
    tied 'h' -> 'w', buffer 'b'. No file exists."""
    from dsckpt.model import Fragment, Kind, LogicalCheckpoint, Piece, Precision, Role, TensorEntry

    o0, o1 = Path("/nowhere/zero_pp_rank_0_mp_rank_00_optim_states.pt"), Path("/nowhere/zero_pp_rank_1_mp_rank_00_optim_states.pt")
    ms = Path("/nowhere/mp_rank_00_model_states.pt")

    def split(role, key, state=None):
        return Piece(role, "float32", (Fragment(o0, (*key, state) if state else key, 2, 4, 0, 0),
                                        Fragment(o1, (*key, state) if state else key, 0, 2, 4, 1)), state_key=state)

    m_key = ("optimizer_state_dict", "single_partition_of_fp32_groups", 0)
    s_key = ("optimizer_state_dict", "base_optimizer_state", "state", 0)
    w = TensorEntry("w", (2, 3), Kind.PARAM, True, (split(Role.MASTER, m_key), split(Role.OPTIM_STATE, s_key, "exp_avg"),
                                                     split(Role.OPTIM_STATE, s_key, "exp_avg_sq"),
                                                     Piece(Role.MODULE, "bfloat16", (Fragment(ms, ("module", "w"), 0, 6, 0),))),
                    group=0)
    f = TensorEntry("f", (4,), Kind.PARAM, False, (Piece(Role.MODULE, "bfloat16", (Fragment(ms, ("module", "f"), 0, 4, 0),)),))
    h = TensorEntry("h", (2, 3), Kind.PARAM, True, w.pieces, tied_to="w", group=0)
    b = TensorEntry("b", (), Kind.BUFFER, False, (Piece(Role.MODULE, "int64", (Fragment(ms, ("module", "b"), 0, 1, 0),)),))
    return LogicalCheckpoint(root=Path("/nowhere"), tag="t", tag_dir=Path("/nowhere/t"), layout=f"zero{stage}",
                             zero_stage=stage, precision=Precision.BF16, dp_world_size=2, pp_world_size=1,
                             tp_world_size=1, ds_version="0.19.8", global_steps=3, global_samples=24, optimizer_step=3,
                             optimizer_wrapper="DeepSpeedZeroOptimizer", entries=(w, f, h, b), files=(o0, o1, ms)), (o0, o1, ms)


def _universal_target(ckpt):
    """The universal target of ``ckpt`` (phases 1 and 2 of plan_universal_reshard)."""
    from dsckpt.ds_writers.source import describe_source
    from dsckpt.ds_writers.target import resolve_universal

    return resolve_universal(describe_source(ckpt, refuse=False))


def test_plan_zero12_source_without_files():
    from dsckpt.ds_writers.plan import RangeCopy
    from dsckpt.ds_writers.universal import plan_universal

    ckpt, (o0, o1, ms) = _logical(2)
    plan = plan_universal(ckpt, _universal_target(ckpt), optimizer_files=(o1, o0), model_files=(ms,))
    assert plan.out_tag == "t_universal" and plan.optimizer_source == o0 and not plan.zero3
    assert [f.path for f in plan.state_files] == ["zero/w/fp32.pt", "zero/w/exp_avg.pt", "zero/w/exp_avg_sq.pt"]
    master = plan.state_files[0]
    assert master.shape == (2, 3) and master.wrapped and master.spec.numel == 6
    assert master.spec.copies == (RangeCopy(o0, ("optimizer_state_dict", "single_partition_of_fp32_groups", 0), 2, 4, 0),
                                  RangeCopy(o1, ("optimizer_state_dict", "single_partition_of_fp32_groups", 0), 0, 2, 4))
    assert plan.state_files[1].spec.copies[1].key == ("optimizer_state_dict", "base_optimizer_state", "state", 0, "exp_avg")
    assert [(s.path, s.file, s.key) for s in plan.step_files] == [
        ("zero/w/step.pt", o0, ("optimizer_state_dict", "base_optimizer_state", "state", 0, "step"))]
    assert [(c.path, c.key, c.dtype) for c in plan.cast_files] == [
        ("zero/f/fp32.pt", ("module", "f"), "bfloat16"), ("zero/h/fp32.pt", ("module", "w"), "bfloat16"),
        ("zero/b/fp32.pt", ("module", "b"), "int64")]
    assert plan.copied_nbytes == 3 * 6 * 4


def test_plan_zero3_source_without_files():
    from dsckpt.ds_writers.universal import plan_universal

    ckpt, (o0, o1, ms) = _logical(3)
    plan = plan_universal(ckpt, _universal_target(ckpt), optimizer_files=(o0, o1), model_files=(ms,))
    assert plan.zero3 and plan.step_files == () and plan.cast_files == ()
    assert [(f.shape, f.wrapped) for f in plan.state_files] == [((6,), False)] * 3


def test_plan_refuses_incomplete_fragments():
    from dataclasses import replace

    from dsckpt.ds_writers.universal import plan_universal
    from dsckpt.model import Piece

    ckpt, (o0, o1, ms) = _logical(2)
    w = ckpt.entries[0]
    short = Piece(w.pieces[0].role, "float32", w.pieces[0].fragments[:1])
    ckpt = replace(ckpt, entries=(replace(w, pieces=(short, *w.pieces[1:])), *ckpt.entries[1:]))
    with pytest.raises(CorruptCheckpointError, match=r"tensor 'w': its master copy covers 4 of elements \[0, 6\)"):
        plan_universal(ckpt, _universal_target(ckpt), optimizer_files=(o0, o1), model_files=(ms,))


# --- real DeepSpeed ---------------------------------------------------------------------------------

# the rank count -> the source fixtures loaded on it (each different from the source's); FIXTURE@STAGE: the ZeRO stage
# of the loading engine (a stage-0 source's folder loads under ZeRO-1 or ZeRO-2)
def _universal_cases() -> dict[int, list[str]]:
    from ds_launch import jit_op_built

    # Python-int steps (step.pt holds the int, as ds_to_universal's): a fused FP16_Optimizer stage-0 save (FusedAdam)
    # and DeepSpeedCPULion under CPU offload, each where DeepSpeed's JIT op is built (tests/ds_launch.py jit_op_built)
    int_steps = (["s0_bf16_w1_adapter_fused@1"] if jit_op_built("fused_adam") else []) + (
        ["optim/lion_s2_bf16_w2_offload"] if jit_op_built("cpu_lion") else [])
    return {3: ["s2_bf16_w2_2groups", "s1_bf16_w2_bf16opt", "s1_fp32_w2", "s0_bf16_w2@1", *int_steps],
            2: ["s3_bf16_w3_subgroups", "s0_fp32_w1@2"]}


DS_UNIVERSAL_CASES = _universal_cases()
TAMPERED = "s2_bf16_w2_2groups"  # its launch also loads a copy with fc1.weight's exp_avg and exp_avg_sq swapped


@pytest.fixture(scope="module")
def ds_universal_runs(tmp_path_factory):
    from ds_launch import DEEPSPEED, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_universal")
    runs = {}
    for world, names in DS_UNIVERSAL_CASES.items():
        pairs = []
        for name in names:
            out = base / f"{name.replace('@', '_at')}_universal"
            write_universal(FIXTURES / name.split("@")[0] / "ckpt", out, verify="quick")
            pairs.append(f"{name}={out}")
            if name == TAMPERED:  # a control the check must reject: one param's two Adam moments swapped
                control = base / "tampered"
                shutil.copytree(out, control)
                folder = control / (control / "latest_universal").read_text() / "zero" / "fc1.weight"
                (folder / "exp_avg.pt").rename(folder / "swap.pt")
                (folder / "exp_avg_sq.pt").rename(folder / "exp_avg.pt")
                (folder / "swap.pt").rename(folder / "exp_avg_sq.pt")
                pairs.append(f"{name}={control}")
        cwd = base / f"to{world}"
        cwd.mkdir()
        runs[world] = run_check_script("ds_reshard_check.py", pairs, args=["--universal"], world=world, cwd=cwd,
                                       timeout=900)
    return runs


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("world", sorted(DS_UNIVERSAL_CASES), ids=lambda w: f"to{w}ranks")
def test_deepspeed_loads_universal_output(ds_universal_runs, world):
    """load_universal on another rank count: masters, Adam moments and step exact (fragment API and, at
    stage 1/2, the flat partitions), module weights, global steps; frozen params and buffers left exactly as
    the new engine held them (DeepSpeed 0.19.8 restores neither); then one more training step. Stage-0 sources
    (bf16 FP16_UnfusedOptimizer 2 -> 3 ranks under ZeRO-1, fp32 1 -> 2 ranks under ZeRO-2) too."""
    from ds_launch import passed_except_controls

    rc, results, log = ds_universal_runs[world]
    results, control = passed_except_controls(results, log)
    if TAMPERED in DS_UNIVERSAL_CASES[world]:
        assert len(control) == 1 and not control[0]["ok"], log
        problems = {p.split(": ", 1)[1] for p in control[0]["problems"]}
        assert {f"{k} of 'fc1.weight' differs from the source (fragment API)" for k in ("exp_avg", "exp_avg_sq")} \
            <= problems, problems
        assert all("'fc1.weight'" in p for p in problems), problems
        assert rc == 1, log
    else:
        assert rc == 0, log
    assert [r["fixture"] for r in results] == DS_UNIVERSAL_CASES[world]
    assert all(r["world_size"] == world for r in results)
