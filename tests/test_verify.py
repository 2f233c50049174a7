"""dsckpt verify: one audit of a whole checkpoint, on real DeepSpeed checkpoints and damaged copies."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, fixtures_where, ids, tree_digest
from scan_helpers import copy_fixture, plant

from dsckpt.cli import main
from dsckpt.model import Role
from dsckpt.readers.same_save import same_save_problems
from dsckpt.verify import Area, verify


def _nonfinite_by_design(fx) -> bool:
    """Fixtures saved with inf/NaN on purpose (fp16 BatchNorm overflow, an fp16 param beyond range)."""
    return any(t.is_floating_point() and not bool(torch.isfinite(t).all()) for t in fx.truth().values())


DAMAGED_BY_DESIGN = {f.name for f in all_fixtures() if _nonfinite_by_design(f)}
CLEAN = [f for f in all_fixtures() if f.name not in DAMAGED_BY_DESIGN]


def _run(*args: str):
    return CliRunner().invoke(main, ["verify", *args])


@pytest.mark.parametrize("fx", CLEAN, ids=ids(CLEAN))
def test_every_clean_fixture_verifies_ok(fx):
    before = tree_digest(fx.ckpt)
    res = _run("--json", str(fx.ckpt))
    assert res.exit_code == 0, res.output
    report = json.loads(res.stdout)
    assert report["ok"] and report["problems"] == []
    assert report["stored_tensors"] > 0
    assert tree_digest(fx.ckpt) == before


def test_damaged_by_design_fixtures_are_flagged_by_value():
    assert DAMAGED_BY_DESIGN, "the fp16 overflow fixtures exist"
    for name in sorted(DAMAGED_BY_DESIGN):
        fx = next(f for f in all_fixtures() if f.name == name)
        report = verify(fx.ckpt)
        assert not report.ok, name
        assert {p.area for p in report.problems} == {Area.VALUES}, (name, report.problems)
        assert any("nonfinite" in p.message for p in report.problems), name


def test_text_output_and_exit_codes(tmp_path):
    fx = fixtures_where(stage=2, dtype="bf16")[0]
    res = _run(str(fx.ckpt))
    assert res.exit_code == 0
    assert res.stdout.splitlines()[-1].startswith("ok: files from one save")
    res = _run(str(tmp_path / "missing"))
    assert res.exit_code == 2  # click: the path does not exist
    (tmp_path / "empty").mkdir()
    res = _run(str(tmp_path / "empty"))
    assert res.exit_code == 3 and res.stderr.startswith("dsckpt: error: ")


def test_a_16bit_copy_that_is_not_its_rounded_master_is_a_problem(tmp_path):
    fx = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_2groups")
    ckpt = copy_fixture(fx, tmp_path)
    plant(ckpt, "fc1.weight", Role.MODULE, 3, 0.5)
    res = _run("--json", str(ckpt))
    assert res.exit_code == 1, res.output
    problems = json.loads(res.stdout)["problems"]
    assert [(p["area"], p["message"].split(":")[0]) for p in problems] == [("values", "mismatch")]
    assert "fc1.weight" in problems[0]["message"]


def test_rank_files_from_two_saves_are_named(tmp_path):
    a = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_2groups")
    b = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_roundrobin")
    ckpt = copy_fixture(a, tmp_path)
    name = "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shutil.copy(b.ckpt / "global_step3" / name, ckpt / "global_step3" / name)
    report = verify(ckpt)
    files_problems = [p for p in report.problems if p.area is Area.FILES]
    assert [p.where for p in files_problems] == ["ds_config"]
    assert name in files_problems[0].message and "mp_rank_00_model_states.pt" in files_problems[0].message
    assert "they come from different saves" in files_problems[0].message
    res = _run(str(ckpt))
    assert res.exit_code == 1 and "files      ds_config: files disagree" in res.stdout
    # every other command refuses such a set outright
    res = CliRunner().invoke(main, ["to-fp32", str(ckpt), str(tmp_path / "o.safetensors")])
    assert res.exit_code == 3 and "ds_config: files disagree" in res.stderr and name in res.stderr


def test_two_steps_of_one_run_with_the_same_config_are_told_apart(tmp_path):
    # s1_fp32_w2 and its accelerate-tag twin: the same run and config, saved under another tag; make
    # rank 1's optimizer file look one step older (Adam step 2): only the step counts can tell.
    import torch

    from dsckpt import parsed_tree, safe_load, safe_save

    fx = next(f for f in all_fixtures() if f.name == "s1_fp32_w2")
    ckpt = copy_fixture(fx, tmp_path)
    victim = ckpt / "global_step3" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    tree = parsed_tree.materialize(safe_load.load(victim))
    for st in tree["optimizer_state_dict"]["base_optimizer_state"]["state"].values():
        st["step"] = torch.tensor(2.0)
    safe_save.save(tree, victim)
    report = verify(ckpt)
    assert [(p.area, p.where) for p in report.problems] == [(Area.FILES, "adam_step")]
    assert '["2.0"] in zero_pp_rank_1_mp_rank_00_optim_states.pt' in report.problems[0].message
    res = CliRunner().invoke(main, ["info", str(ckpt)])
    assert res.exit_code == 3 and "adam_step: files disagree" in res.stderr


def test_an_unproven_binding_is_a_problem():
    fx = next(f for f in all_fixtures(include_ambiguous=True) if f.name == "s0_fp32_w1_adapter")
    report = verify(fx.ckpt)
    assert [(p.area, p.where) for p in report.problems] == [(Area.BINDINGS, "frozen.bias, ln.bias, ln.weight")]


def test_same_save_problems_is_pure_and_names_each_value():
    facts = [("a.pt", {"global_steps": 3, "ds_version": "0.19.8"}),
             ("b.pt", {"global_steps": 3, "ds_version": "0.19.8"}),
             ("c.pt", {"global_steps": 4})]
    ((fact, message),) = same_save_problems(facts)
    assert fact == "global_steps"
    assert message.startswith("files disagree (3 in a.pt, b.pt | 4 in c.pt)")
    assert same_save_problems(facts[:2]) == []
    nested = [("a.pt", {"ds_config": {"zero": {"stage": 2, "rr": True}, "bf16": {"enabled": True}}}),
              ("b.pt", {"ds_config": {"zero": {"stage": 2}, "bf16": {"enabled": True}}})]
    ((fact, message),) = same_save_problems(nested)
    assert message.startswith("files disagree (ds_config.zero.rr = true in a.pt | ds_config.zero.rr = absent in b.pt)")


# ------------------------------------------------------------------------------------------------
# Records: every CRC, in the same pass, all problems collected


def _flip(path, offset: int, bit: int = 2) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ (1 << bit)]))


def _storage(path, key):
    from dsckpt import safe_load
    from dsckpt.readers.common import lookup

    return lookup(safe_load.load(path), key, path).storage


def test_flipped_bits_in_two_files_are_both_named_and_nothing_else_is_lost(tmp_path):
    fx = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_2groups")
    ckpt = copy_fixture(fx, tmp_path)
    tag = ckpt / "global_step3"
    o1 = tag / "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"
    s1 = _storage(o1, ("optimizer_state_dict", "single_partition_of_fp32_groups", 0))
    _flip(o1, s1.file_offset + 5)
    ms = tag / "mp_rank_00_model_states.pt"
    # an int64 buffer: no value check reads it, the record sweep must
    s2 = _storage(ms, ("module", "bn.num_batches_tracked"))
    _flip(ms, s2.file_offset)
    report = verify(ckpt)
    records = sorted((p.where, p.message) for p in report.problems if p.area is Area.RECORDS)
    assert [w for w, _ in records] == [f"{o1.name} {s1.record}", f"{ms.name} {s2.record}"]
    assert all("fails its CRC32 check" in m for _, m in records)
    assert report.records_checked > 0
    res = _run("--json", str(ckpt))
    assert res.exit_code == 1
    assert sum(p["area"] == "records" for p in json.loads(res.stdout)["problems"]) == 2


def test_clean_run_checks_every_record_of_every_file(tmp_path):
    import zipfile

    fx = next(f for f in all_fixtures() if f.name == "s3_bf16_w3_subgroups")
    report = verify(fx.ckpt)
    assert report.ok
    assert report.records_checked == sum(len(zipfile.ZipFile(f).infolist()) for f in report.files)


def test_legacy_files_have_no_crc_and_say_so():
    fx = next(f for f in all_fixtures() if f.name == "s2_fp32_w2_legacy")
    res = _run(str(fx.ckpt))
    assert res.exit_code == 0
    assert "note: no CRC (legacy non-zip format): bit rot cannot be detected in mp_rank_00_model_states.pt" in res.stdout
    assert "no records with CRCs to check" in res.stdout


def test_flat_order_is_cross_checked_against_the_module_views(tmp_path):
    fx = next(f for f in all_fixtures() if f.name == "s2_bf16_w2_roundrobin")
    assert verify(fx.ckpt).notes == ()
    out = tmp_path / "r"
    res = CliRunner().invoke(main, ["reshard", "-q", str(fx.ckpt), str(out), "-n", "1"])
    assert res.exit_code == 0, res.output
    report = verify(out)
    # round-robin order depends on the world size: the resharded order is new, the module layout old;
    # the 16-bit values still prove every binding (no mismatch), and the note says what was not confirmed
    assert report.ok, report.problems
    assert [n.split(" of its")[0] for n in report.notes] == [
        "mp_rank_00_model_states.pt: param_shapes[0] puts 'fc1.weight' at element 66",
        "mp_rank_00_model_states.pt: param_shapes[1] puts 'bn.weight' at element 7"]
    assert all("not confirmed by the module's layout" in n for n in report.notes)
