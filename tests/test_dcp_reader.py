"""DCP folders read for a writer (issue 40): what :func:`dsckpt.dcp_reader.describe_dcp` gives of real DCP folders
written by torch (tests/fixtures/dcp, generate_dcp.py: plain ``dcp.save`` of ``get_state_dict``, nested and flattened,
pure bf16, model-only, FSDP2 on 2 gloo ranks) equals the truth recorded from the live model and optimizer, exactly;
hand-made corruptions of them are refused with the key named (exit 3, nothing written); and the ``to-dcp`` export of
every fixture family reads back as the DeepSpeed checkpoint's logical content (masters, moments, step, groups)."""

from __future__ import annotations

import io
import json
import pickle
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest
from safetensors.torch import load_file

from dsckpt.assemble import read_entry
from dsckpt.checkpoint import open_checkpoint
from dsckpt.cli import main
from dsckpt.dcp_reader import DcpOptimizerFormat, describe_dcp
from dsckpt.dcp_writer import plan_to_dcp, run_to_dcp
from dsckpt.errors import CorruptCheckpointError
from dsckpt.model import Kind, Role

DCP = FIXTURES / "dcp"
NAMES = ["plain_adamw_w1", "plain_adamw_flat_w1", "plain_bf16_w1", "model_only_w1", "fsdp2_adamw_w2",
         "trainer_fsdp2_gpt2_w2", "accelerate_fsdp2_w2"]


def _cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(main, list(args))
    return r.exit_code, r.stdout, r.stderr


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and tuple(a.shape) == tuple(b.shape) and _bits(a) == _bits(b)


def _plain(v: Any) -> Any:
    return list(v) if isinstance(v, tuple) else v


@pytest.mark.parametrize("name", NAMES, ids=NAMES)
def test_reader_gives_the_recorded_truth(name: str) -> None:
    """Every model tensor (params at their stored dtype, buffers, the tied alias), every optimizer state tensor, each
    param's step, each group's params and hyper-parameters, ties, trainable/frozen, exactly as the live objects held
    them; the folder is not modified."""
    fx = DCP / name
    meta = json.loads((fx / "truth.json").read_text())
    truth = load_file(str(fx / "truth.safetensors"))
    before = tree_digest(fx / "ckpt")
    src = describe_dcp(fx / "ckpt")
    ckpt, cache = src.logical, src.cache
    # .metadata's order: the state dict's for one process; for a multi-rank save DCP's global plan puts what it
    # de-duplicated (the replicated BN buffers) after the sharded tensors
    names = [e.name for e in ckpt.entries]
    assert names == meta["state_dict_names"] if meta["world_size"] == 1 else sorted(names) == sorted(
        meta["state_dict_names"])
    for e in ckpt.entries:
        want = truth[f"{'param' if e.kind is Kind.PARAM else 'buffer'}/{e.name}"]
        assert _same(read_entry(e, cache, Role.MODULE if e.tied_to is None else None), want), e.name
    assert {e.name for e in ckpt.buffers} == set(meta.get("buffers", []))
    # a Trainer checkpoint-N/ or an Accelerate save_state folder: {"model": M} and {"optimizer": O} folders
    run_folder = name.startswith(("trainer_", "accelerate_"))
    if meta.get("model_only"):
        assert src.model_only and src.optimizer is None and ckpt.optimizer_groups == () and ckpt.tied == {}
        assert all(e.ambiguous for e in ckpt.params)  # which were trained is not recorded
        assert ckpt.optimizer_step is None and "model only" in ckpt.notes[0]
        return
    opt = src.optimizer
    assert opt is not None and opt.key == ("optimizer" if run_folder else "optim") and opt.optimizer_class == "AdamW"
    assert opt.format is DcpOptimizerFormat(meta.get("optimizer_format", "nested"))
    # the Trainer's global step (trainer_state.json); a plain DCP folder records none
    assert ckpt.global_steps == meta.get("global_step")
    assert ckpt.tied == meta["tied"]
    assert sorted(e.name for e in ckpt.params if e.trainable and e.tied_to is None) == sorted(meta["trainable"])
    assert sorted(e.name for e in ckpt.params if not e.trainable) == sorted(meta["frozen"])
    # per-element states attached by FQN, each equal to the live optimizer's tensor
    assert {p.name: list(p.state_keys) for p in opt.params} == {
        n: [k for k in keys if k != "step"] for n, keys in meta["state_keys"].items()}
    for p in opt.params:
        e = ckpt.entry(p.name)
        assert e.state_keys == p.state_keys
        for key in p.state_keys:
            assert _same(read_entry(e, cache, state=key), truth[f"{key}/{p.name}"]), (p.name, key)
        # the step: a 0-dim float32 tensor, as torch's AdamW holds it
        assert p.step == meta["steps"][p.name] == truth[f"step/{p.name}"].item() and p.step_dtype == "float32"
        assert p.other == ()
    assert ckpt.optimizer_step == 3
    assert opt.groups_saved is (opt.format is DcpOptimizerFormat.NESTED)
    assert [list(g.param_names) for g in ckpt.optimizer_groups] == [g["params"] for g in meta["param_groups"]]
    for g, want in zip(ckpt.optimizer_groups, meta["param_groups"], strict=True):
        assert {k: _plain(v) for k, v in g.hyperparams} == want["hyperparams"]
        assert list(dict(g.hyperparams)) == list(want["hyperparams"])  # the optimizer's key order
        assert all(isinstance(dict(g.hyperparams)[k], tuple) for k in meta["tuples"])  # betas as the group held it
        assert g.step is None  # torch keeps the step per param
        assert all(ckpt.entry(n).group == g.index for n in g.param_names)
    assert tree_digest(fx / "ckpt") == before


def test_bf16_model_tensors_are_the_only_copy() -> None:
    """A model trained in bf16 saves bf16 params and moments and no fp32 master anywhere: the reader says bf16 and
    gives the stored bf16 values (a writer upcasts them exactly; nothing more precise exists)."""
    src = describe_dcp(DCP / "plain_bf16_w1" / "ckpt")
    e = src.logical.entry("fc1.weight")
    assert src.logical.precision.value == "bf16"
    assert [(p.role, p.dtype) for p in e.pieces] == [(Role.MODULE, "bfloat16"), (Role.OPTIM_STATE, "bfloat16"),
                                                    (Role.OPTIM_STATE, "bfloat16")]
    assert e.piece(Role.MASTER) is None and e.source_for_fp32().dtype == "bfloat16"


def test_fsdp2_mixed_precision_saves_fp32_masters() -> None:
    """The Trainer ran bf16 (FSDP2's MixedPrecisionPolicy casts for compute only): its sharded params, and so the
    saved model tensors, are fp32 (the masters), as the live model held them."""
    src = describe_dcp(DCP / "trainer_fsdp2_gpt2_w2" / "ckpt")
    meta = json.loads((DCP / "trainer_fsdp2_gpt2_w2" / "truth.json").read_text())
    assert meta["model_dtypes"] == ["torch.float32"] and src.logical.precision.value == "fp32"
    assert {e.stored_dtype for e in src.logical.entries} == {"float32"}


def test_flattened_groups_are_rebuilt_from_equal_hyperparameters() -> None:
    """The flattened save keeps each param's hyper-parameters, not the split: params with equal ones form one group,
    in the order their first param appears, and a note says so. Here the two groups differ (weight decay), so the
    rebuilt split is the live one."""
    src = describe_dcp(DCP / "plain_adamw_flat_w1" / "ckpt")
    nested = describe_dcp(DCP / "plain_adamw_w1" / "ckpt")
    assert src.logical.optimizer_groups == nested.logical.optimizer_groups
    assert any("flattened" in n for n in src.logical.notes)


@pytest.mark.parametrize("name", ["plain_adamw_w1", "fsdp2_adamw_w2", "model_only_w1"])
def test_info_shows_step_groups_and_kind(name: str) -> None:
    code, stdout, stderr = _cli("info", str(DCP / name / "ckpt"))
    assert code == 0, stderr
    if name == "model_only_w1":
        assert "optimizer step unknown" in stdout and "optimizer    none: model only" in stdout, stdout
        assert "(0 trainable, 0 frozen, 271 undetermined)" in stdout, stdout
        return
    assert "optimizer wrapper torch.optim.AdamW (DCP)" in stdout and "optimizer step 3\n" in stdout, stdout
    assert "optimizer    AdamW, 2 param groups\n  group 0    3 params; weight_decay 0.01, lr 0.01, betas (0.9, " \
           "0.999), eps 1e-08," in stdout, stdout
    assert "  group 1    4 params; weight_decay 0.0," in stdout and "tied         embed.weight = head.weight" in stdout
    assert "(165 trainable, 40 frozen)" in stdout


@pytest.mark.parametrize("name", ["plain_adamw_w1", "fsdp2_adamw_w2"])
def test_to_fp32_scan_verify_of_real_folders(name: str, tmp_path: Path) -> None:
    """to-fp32 writes every model tensor as saved (fp32 here), the tied alias included; scan and verify are clean."""
    truth = load_file(str(DCP / name / "truth.safetensors"))
    out = tmp_path / "m.safetensors"
    assert _cli("to-fp32", "-q", str(DCP / name / "ckpt"), str(out))[0] == 0
    got = load_file(str(out))
    assert sorted(got) == sorted(k.split("/", 1)[1] for k in truth if k.startswith(("param/", "buffer/")))
    for k, v in got.items():
        want = truth.get(f"param/{k}", truth.get(f"buffer/{k}"))
        assert _same(v, want.to(v.dtype)) and _same(v.to(want.dtype), want), k
    assert _cli("scan", str(DCP / name / "ckpt"))[0] == 0
    assert _cli("verify", str(DCP / name / "ckpt"))[0] == 0


# --------------------------------------------------------------------------------------------
# bad input: hand-made corruptions of the real folders


def _copy(name: str, tmp_path: Path) -> Path:
    out = tmp_path / name
    shutil.copytree(DCP / name / "ckpt", out)
    return out


def _metadata(folder: Path) -> Any:
    # test code: the fixture is our own, so torch's loader may read it (dsckpt itself never does)
    return pickle.loads((folder / ".metadata").read_bytes())


def _save_metadata(folder: Path, md: Any) -> None:
    (folder / ".metadata").write_bytes(pickle.dumps(md))


def _drop(md: Any, key: str) -> None:
    del md.state_dict_metadata[key]
    for idx in [i for i in md.storage_data if i.fqn == key]:
        del md.storage_data[idx]


def _refused(folder: Path, tmp_path: Path, *phrases: str) -> None:
    """info and to-fp32 exit 3 with one line naming what is wrong; nothing is written; the folder is unchanged."""
    before = tree_digest(folder)
    for args in (("info", str(folder)), ("to-fp32", "-q", str(folder), str(tmp_path / "out.safetensors"))):
        code, stdout, stderr = _cli(*args)
        assert code == 3, (args, code, stdout, stderr)
        line = stderr.strip()
        assert "\n" not in line and "Traceback" not in line and all(p in line for p in phrases), line
    assert not (tmp_path / "out.safetensors").exists()
    assert tree_digest(folder) == before
    with pytest.raises(CorruptCheckpointError):
        describe_dcp(folder)


def test_metadata_lying_about_a_size(tmp_path: Path) -> None:
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    md.state_dict_metadata["model.fc1.weight"].size = torch.Size([8, 6])
    _save_metadata(folder, md)
    _refused(folder, tmp_path, "model.fc1.weight", "42 elements", "[8, 6]")


def test_metadata_lying_about_a_shape_of_equal_size(tmp_path: Path) -> None:
    """The frozen [5, 7] param claimed [7, 5] (chunk and size agree with each other): caught when the chunk is
    read."""
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    meta = md.state_dict_metadata["model.frozen.weight"]
    meta.size = torch.Size([7, 5])
    meta.chunks[0].sizes = torch.Size([7, 5])
    _save_metadata(folder, md)
    code, _, stderr = _cli("to-fp32", "-q", str(folder), str(tmp_path / "out.safetensors"))
    assert code == 3 and "frozen.weight" in stderr and "float32 [5, 7]" in stderr and "[7, 5]" in stderr, stderr
    assert not (tmp_path / "out.safetensors").exists()


def test_truncated_distcp(tmp_path: Path) -> None:
    folder = _copy("fsdp2_adamw_w2", tmp_path)
    data = folder / "__1_0.distcp"
    data.write_bytes(data.read_bytes()[:-1000])
    _refused(folder, tmp_path, "__1_0.distcp", "bytes")


def test_a_param_without_its_moments(tmp_path: Path) -> None:
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    _drop(md, "optim.state.fc1.weight.exp_avg_sq")
    _save_metadata(folder, md)
    _refused(folder, tmp_path, "'optim.state.fc1.weight.exp_avg_sq' is missing", "has exp_avg but not exp_avg_sq")


def test_a_moment_of_another_shape(tmp_path: Path) -> None:
    """fc2.weight's exp_avg claimed [5, 6] (its chunk too), the param is [6, 5]."""
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    meta = md.state_dict_metadata["optim.state.fc2.weight.exp_avg"]
    meta.size = torch.Size([5, 6])
    meta.chunks[0].sizes = torch.Size([5, 6])
    _save_metadata(folder, md)
    _refused(folder, tmp_path, "'optim.state.fc2.weight.exp_avg' is float32 [5, 6], not the shape of 'fc2.weight' "
             "[6, 5]")


def test_a_state_for_a_param_the_model_lacks(tmp_path: Path) -> None:
    folder = _copy("fsdp2_adamw_w2", tmp_path)
    md = _metadata(folder)
    _drop(md, "model.fc2.bias")
    _save_metadata(folder, md)
    _refused(folder, tmp_path, "optim.state.fc2.bias", "names 'fc2.bias', which the model state lacks")


def test_a_group_naming_an_fqn_the_model_lacks(tmp_path: Path) -> None:
    """A group's ``params`` bytes item rewritten (a new torch.save stream appended to the .distcp, the storage entry
    pointed at it) to name ``fc3.bias``."""
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    key = "optim.param_groups.1.params"
    idx = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[idx]
    data = folder / info.relative_path
    buf = io.BytesIO()
    torch.save(["fc1.bias", "bn.weight", "bn.bias", "fc2.bias", "fc3.bias"], buf)
    start = data.stat().st_size
    data.write_bytes(data.read_bytes() + buf.getvalue())
    info.offset, info.length = start, len(buf.getvalue())
    _save_metadata(folder, md)
    _refused(folder, tmp_path, key, "names 'fc3.bias', which the model state lacks")


class _Pwn:
    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[Any, tuple[str]]:
        import os

        return os.system, (f"touch {self.marker}",)


def _append_bytes_item(folder: Path, md: Any, key: str, obj: Any) -> None:
    """Point the storage entry of bytes item ``key`` at a new torch.save stream of ``obj`` appended to its file."""
    idx = next(i for i in md.storage_data if i.fqn == key)
    info = md.storage_data[idx]
    data = folder / info.relative_path
    buf = io.BytesIO()
    torch.save(obj, buf)
    start = data.stat().st_size
    data.write_bytes(data.read_bytes() + buf.getvalue())
    info.offset, info.length = start, len(buf.getvalue())


def test_a_hyperparameter_that_pickles_a_call(tmp_path: Path) -> None:
    """A group's ``lr`` item that would run ``os.system`` when unpickled: refused by the allow-list with the class
    named, and nothing runs."""
    folder = _copy("plain_adamw_w1", tmp_path)
    marker = tmp_path / "ran"
    md = _metadata(folder)
    _append_bytes_item(folder, md, "optim.param_groups.0.lr", _Pwn(marker))
    _save_metadata(folder, md)
    code, _, stderr = _cli("info", str(folder))
    line = stderr.strip()
    assert code == 3 and "\n" not in line and "'optim.param_groups.0.lr'" in line and "system" in line, stderr
    assert "allow-list" in line and not marker.exists(), stderr


def test_the_number_of_non_tensor_items_is_budgeted(monkeypatch: pytest.MonkeyPatch) -> None:
    """The flattened fixture keeps 11 hyper-parameter items per param (77): refused before any is parsed under a
    budget of 50, read under the default."""
    monkeypatch.setenv("DSCKPT_LIMITS", "max_dcp_values=50")
    code, _, stderr = _cli("info", str(DCP / "plain_adamw_flat_w1" / "ckpt"))
    assert code == 3 and "77 non-tensor items" in stderr and "max_dcp_values=50" in stderr, stderr
    monkeypatch.delenv("DSCKPT_LIMITS")
    assert _cli("info", str(DCP / "plain_adamw_flat_w1" / "ckpt"))[0] == 0


def _step_as_bytes_item(tmp_path: Path, value: Any) -> Path:
    """plain_adamw_w1 with ``fc1.bias``'s step turned into a bytes item holding ``value`` (a Python number, as
    FusedAdam and DeepSpeed's CPU optimizers keep it)."""
    folder = _copy("plain_adamw_w1", tmp_path)
    md = _metadata(folder)
    key = "optim.state.fc1.bias.step"
    md.state_dict_metadata[key] = md.state_dict_metadata["optim.param_groups.0.lr"]  # a BytesStorageMetadata
    idx = next(i for i in md.storage_data if i.fqn == key)
    md.storage_data[type(idx)(key)] = md.storage_data.pop(idx)  # a bytes item's index has no chunk offset
    _append_bytes_item(folder, md, key, value)
    _save_metadata(folder, md)
    return folder


def test_a_step_kept_as_a_python_number(tmp_path: Path) -> None:
    src = describe_dcp(_step_as_bytes_item(tmp_path, 3))
    assert src.optimizer is not None
    step = src.optimizer.param("fc1.bias")
    assert step is not None and step.step == 3 and isinstance(step.step, int) and step.step_dtype is None
    assert src.logical.optimizer_step == 3  # 3 and 3.0 agree


def test_a_step_that_is_not_a_number(tmp_path: Path) -> None:
    """A ``step`` bytes item holding a string (read through the allow-listed unpickler, never run)."""
    _refused(_step_as_bytes_item(tmp_path, "three"), tmp_path, "optim.state.fc1.bias.step", "not a number")


def _tiny_save(tmp_path: Path, *, all_params: bool, state_dict: bool = False) -> Path:
    """A TinyNet trained one step with AdamW over ``model.parameters()`` (frozen ones included) or the trained ones,
    saved by ``dcp.save`` from get_state_dict (or, ``state_dict``, from the live objects' own state dicts)."""
    import sys

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict

    sys.path.insert(0, str(FIXTURES))
    import fixture_models as fm

    model = fm.TinyNet()
    opt = torch.optim.AdamW(model.parameters() if all_params else
                            [q for q in model.parameters() if q.requires_grad], lr=1e-2)
    ids, tgt = fm.make_batch(0, 0)
    torch.nn.functional.cross_entropy(model(ids), tgt).backward()
    opt.step()
    msd, osd = (model.state_dict(), opt.state_dict()) if state_dict else get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path / "save"), no_dist=True)
    return tmp_path / "save"


def test_params_in_a_group_without_state_are_said(tmp_path: Path) -> None:
    """AdamW given model.parameters(), frozen ones included (torch keeps them in the group, with no state): the
    group lists them, they count frozen, and a note says why."""
    src = describe_dcp(_tiny_save(tmp_path, all_params=True))
    assert "frozen.weight" in src.logical.optimizer_groups[0].param_names
    assert not src.logical.entry("frozen.weight").trainable and src.logical.entry("fc1.weight").trainable
    assert any(n.startswith("2 param(s) of the optimizer's groups hold no optimizer state") and "frozen.bias" in n
               for n in src.logical.notes), src.logical.notes


def test_an_optimizer_state_keyed_by_index_is_refused(tmp_path: Path) -> None:
    """``dcp.save({"model": model.state_dict(), "optim": optimizer.state_dict()})`` (torch numbers the params):
    refused by name, with what to save instead, rather than bound by guess."""
    _tiny_save(tmp_path, all_params=False, state_dict=True)
    code, _, stderr = _cli("info", str(tmp_path / "save"))
    assert code == 3 and "keyed by index ('optim.state.0." in stderr and "get_state_dict" in stderr, stderr


# --------------------------------------------------------------------------------------------
# round-trip groundwork: to-dcp of every family, read back, is the DeepSpeed checkpoint's logical content

#: every fixture family test_to_dcp.py exports whose DCP names are the logical names (AutoEP writes the HF model's
#: fused experts and TP x pipeline DeepSpeed's merge: their values are proven by tests/test_to_dcp.py against the
#: recorded truth instead), and the optimizer fixtures to-dcp exports (not SGD: DeepSpeed saves no step for it, and
#: to-dcp refuses it)
ROUND_TRIP = [
    "s0_fp32_w1", "s0_bf16_w2", "s0_fp16_w1_bnoverflow", "s1_fp32_w2", "s1_bf16_w3", "s1_bf16_w2_bf16opt",
    "s1_fp16_w3_cpuforced", "s2_fp32_w4", "s2_bf16_w2_2groups", "s2_bf16_w2_roundrobin", "s2_fp16_w2_cpuforced",
    "s3_fp32_w2", "s3_bf16_w3_subgroups", "s3_fp16_w2_cpuforced",
    "pp2_fp32", "pp2_bf16", "pp2_dp2_fp32", "moe_s2_bf16_w2_ep2", "moe_s1_bf16_w4_ep2", "moe_s0_fp32_w2_ep2",
    "moe_s0_bf16_w2_ep2", "moe_s0_bf16_w2_ep2_fused",
    "optim/adagrad_s2_fp32_w2", "optim/amsgrad_s2_bf16_w2", "optim/rmsprop_s3_fp32_w2",
]


@pytest.mark.parametrize("name", ROUND_TRIP, ids=[n.rsplit("/", 1)[-1] for n in ROUND_TRIP])
def test_to_dcp_reads_back_as_the_checkpoint(name: str, tmp_path: Path) -> None:
    """Masters (trained params: the fp32 master; frozen params and buffers as saved), every per-element state, each
    param's step (DeepSpeed's group step, else its optimizer step) and the groups (params in order, every saved
    hyper-parameter, plus exactly the torch defaults to-dcp added) equal bit for bit."""
    c = open_checkpoint(FIXTURES / name / "ckpt", check_master_copies=True)
    plan = plan_to_dcp(c.logical, tmp_path / "dcp")
    run_to_dcp(plan, c.cache)
    src = describe_dcp(tmp_path / "dcp")
    back, ds = src.logical, c.logical
    assert src.optimizer is not None and src.optimizer.format is DcpOptimizerFormat.NESTED
    assert [e.name for e in back.entries] == [e.name for e in ds.entries]
    assert back.tied == ds.tied
    for e in ds.entries:
        b = back.entry(e.name)
        assert (b.kind, b.shape, b.trainable) == (e.kind, e.shape, e.trainable), e.name
        assert _same(read_entry(b, src.cache), read_entry(e, c.cache)), e.name
        if e.tied_to is not None:
            continue
        assert b.state_keys == e.state_keys, e.name
        for key in e.state_keys:
            assert _same(read_entry(b, src.cache, state=key), read_entry(e, c.cache, state=key)), (e.name, key)
    step_of = {n: g.step if g.step is not None else ds.optimizer_step for g in ds.optimizer_groups
               for n in g.param_names}
    steps = src.optimizer.steps
    assert set(steps) == {e.name for e in ds.entries if e.state_keys and e.tied_to is None}
    for n, s in steps.items():
        if step_of.get(n) is None:  # SGD keeps none
            assert s is None, n
        else:
            assert s == float(step_of[n]), (n, s, step_of[n])
    assert back.optimizer_step == (ds.optimizer_step if {s for s in steps.values()} != {None} else None)
    assert [g.param_names for g in back.optimizer_groups] == [
        tuple(n for n in g.param_names if n not in ds.tied) for g in ds.optimizer_groups]
    assert back.optimizer_type == plan.optimizer_class
    for g, d in zip(back.optimizer_groups, ds.optimizer_groups, strict=True):
        have = dict(g.hyperparams)
        kept = dict(d.hyperparams)
        assert {k: _plain(have[k]) for k in kept if k in have} == {k: _plain(v) for k, v in kept.items()
                                                                   if k in have}
        assert set(have) - set(kept) == set(plan.defaults_added)


def test_the_run_folder_names_are_the_writers() -> None:
    from dsckpt import dcp_reader, run_folder_dcp

    assert (dcp_reader.FSDP_MODEL_FOLDER, dcp_reader.FSDP_OPTIM_FOLDER) == (run_folder_dcp.MODEL_FOLDER,
                                                                           run_folder_dcp.OPTIM_FOLDER)


def test_trainer_run_folder_parts(tmp_path: Path) -> None:
    """A Trainer checkpoint-N/ saved under FSDP2 is read as one checkpoint from its two DCP folders; without
    optimizer_0/ it is model-only; an optimizer_0/ whose .metadata is missing (an unfinished save) is refused."""
    src = DCP / "trainer_fsdp2_gpt2_w2" / "ckpt"
    code, stdout, stderr = _cli("info", str(src))
    assert code == 0, stderr
    assert "progress     global step 3, samples unknown, optimizer step 3" in stdout, stdout
    assert "tied         lm_head.weight = transformer.wte.weight" in stdout and "optimizer_0/.metadata" in stdout
    out = tmp_path / "m.safetensors"
    assert _cli("to-fp32", "-q", str(src), str(out))[0] == 0
    truth = load_file(str(DCP / "trainer_fsdp2_gpt2_w2" / "truth.safetensors"))
    got = load_file(str(out))
    assert sorted(got) == sorted(k.split("/", 1)[1] for k in truth if k.startswith("param/"))
    assert all(_same(v, truth[f"param/{k}"]) for k, v in got.items())
    model_only = tmp_path / "model_only"
    shutil.copytree(src, model_only, ignore=shutil.ignore_patterns("optimizer_0"))
    assert describe_dcp(model_only).model_only
    unfinished = tmp_path / "unfinished"
    shutil.copytree(src, unfinished)
    (unfinished / "optimizer_0" / ".metadata").unlink()
    code, _, stderr = _cli("info", str(unfinished))
    assert code == 3 and "optimizer_0: no .metadata" in stderr, stderr


@pytest.mark.parametrize("rel", ["hf_llama_z2_bf16_w2/ckpt", "accelerate_s2_bf16_w2/state"], ids=["trainer", "accelerate"])
def test_run_folder_to_dcp_reads_back_as_the_checkpoint(rel: str, tmp_path: Path) -> None:
    """``to-dcp`` of a Trainer / Accelerate DeepSpeed folder writes the FSDP2 run folder; read back as one DCP source
    it holds the checkpoint's masters, moments and steps, the Trainer's global step, and the groups: DeepSpeed's for
    Accelerate, the Trainer's own split of the same trained params (run_folder_dcp.regroup) for the Trainer."""
    from dsckpt.run_folder_dcp import plan_run_folder_dcp, run_folder_client, run_run_folder_dcp

    out = tmp_path / "fsdp"
    c = open_checkpoint(FIXTURES / rel, check_master_copies=True)
    target = None
    if rel.startswith("hf_llama"):
        # the groups transformers 5.23's Trainer builds (as tests/test_run_folder_dcp.py writes them out, so that the
        # default tier needs no transformers import): norm weights apart, the frozen tied embeddings in neither
        trained = [n for g in c.logical.optimizer_groups for n in g.param_names if n not in c.logical.tied]
        no_decay = tuple(n for n in trained if "norm" in n)
        target = (tuple(n for n in trained if n not in no_decay), no_decay)
    client = run_folder_client(FIXTURES / rel)
    assert client is not None
    run_run_folder_dcp(plan_run_folder_dcp(c.logical, c.cache, out, client=client, target_groups=target), c.cache)
    src = describe_dcp(out)
    back, ds = src.logical, c.logical
    assert src.optimizer is not None and src.optimizer.key == "optimizer"
    assert sorted(e.name for e in back.entries) == sorted(e.name for e in ds.entries)
    # a tie is proven where the alias equals a param with optimizer state; the Llama's tied embeddings are frozen,
    # so nothing in the DCP folder tells a tie from two frozen params of equal values: both are kept as saved
    assert back.tied == {a: s for a, s in ds.tied.items() if ds.entry(s).trainable}
    assert rel.startswith("accelerate") or ds.tied == {"lm_head.weight": "model.embed_tokens.weight"}
    for e in ds.entries:
        b = back.entry(e.name)
        assert _same(read_entry(b, src.cache), read_entry(e, c.cache)), e.name
        assert b.trainable == e.trainable and b.state_keys == (e.state_keys if e.tied_to is None else b.state_keys)
        for key in e.state_keys if e.tied_to is None else ():
            assert _same(read_entry(b, src.cache, state=key), read_entry(e, c.cache, state=key)), (e.name, key)
    assert set(src.optimizer.steps.values()) == {float(ds.optimizer_step)} and back.optimizer_step == ds.optimizer_step
    trained = [n for g in ds.optimizer_groups for n in g.param_names if n not in ds.tied]
    if rel.startswith("accelerate"):
        assert back.global_steps is None
        assert [g.param_names for g in back.optimizer_groups] == [tuple(trained)]
    else:
        assert back.global_steps == ds.global_steps == 3
        assert len(back.optimizer_groups) == 2
        assert sorted(n for g in back.optimizer_groups for n in g.param_names) == sorted(trained)
