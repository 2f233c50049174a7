"""Every optimizer whose state is per element (issue 32, item 2): real DeepSpeed 0.19.8 saves of SGD with momentum,
Adagrad, AdamW amsgrad, RMSprop (a torch.optim class named in the config), Muon with its auxiliary Adam groups,
Lion, and (GPU) Lamb and fp16 SGD, read, exported and resharded; every state tensor compared bit for bit with the
truth the engine gave at save time (tests/fixtures/generate_optim.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import Fixture
from safetensors.torch import load_file
from scan_helpers import read_copy

from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.model import Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

OPTIM_DIR = Path(__file__).parent / "fixtures" / "optim"
ALL = [Fixture(p.parent.name, p.parent, json.loads(p.read_text())) for p in sorted(OPTIM_DIR.glob("*/truth.json"))]
# What DeepSpeed 0.19.8 cannot resume: refused by name (test_refused_by_name)
REFUSED = {"adagrad_s3_fp32_w2": "Adagrad at ZeRO-3"}
OK = [f for f in ALL if f.name not in REFUSED]
IDS = [f.name for f in OK]


def _truth(fx: Fixture) -> dict:
    return load_file(str(fx.dir / "truth.safetensors"))


def _state_keys(fx: Fixture) -> dict[str, tuple[str, ...]]:
    """name -> the per-element state keys of its optimizer group, as the engine had them."""
    return {n: tuple(g["state_keys"]) for g in fx.meta["groups"] for n in g["names"]}


def _check_against_truth(path: Path, fx: Fixture, *, world: int | None = None, stage: int | None = None) -> int:
    """Read ``path`` and compare every master and every optimizer state with ``fx``'s truth, bit for bit; the
    groups' names, steps and hyper-parameters with truth.json. Returns the number of tensors compared."""
    cache = FileCache()
    ckpt = read_checkpoint(path, cache=cache)
    truth = _truth(fx)
    keys = _state_keys(fx)
    if world is not None:
        assert ckpt.dp_world_size == world
    if stage is not None:
        assert ckpt.zero_stage == stage
    assert ckpt.optimizer_type == fx.meta["config"]["optimizer"]["type"]
    checked = 0
    for e in ckpt.params:
        if e.tied_to is not None or e.name not in fx.meta["trainable"]:
            continue
        assert e.state_keys == keys[e.name], (e.name, e.state_keys)
        assert torch.equal(read_copy(e, cache, Role.MASTER), truth[f"param/{e.name}"]), e.name
        for k in keys[e.name]:
            got, want = read_copy(e, cache, k), truth[f"{k}/{e.name}"]
            assert got.dtype == want.dtype and torch.equal(got, want), (e.name, k)
            checked += 1
    assert checked == sum(len(keys[n]) for n in fx.meta["trainable"]) > 0
    want_groups = [(tuple(g["names"]), g["step"], g["hyperparams"]) for g in fx.meta["groups"]]
    got_groups = [(g.param_names, g.step, {k: _jsonable(v) for k, v in g.hyperparams}) for g in ckpt.optimizer_groups]
    assert [(n, s) for n, s, _ in got_groups] == [(n, s) for n, s, _ in want_groups]
    for (_, _, got), (_, _, want) in zip(got_groups, want_groups):
        assert {k: got[k] for k in want} == want
    cache.finish_checks()
    return checked


def _jsonable(v):
    if hasattr(v, "item") and getattr(v, "numel", 0) == 1:
        return v.item()
    if isinstance(v, (list, tuple)):
        return [_jsonable(x) for x in v]
    return v


def _reshard(src: Path, out: Path, world: int, stage: int | None = None) -> Path:
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world, zero_stage=stage, facts=read_source_facts(ckpt, cache))
    run_reshard(plan, out, cache=cache)
    return out


@pytest.mark.parametrize("fx", OK, ids=IDS)
def test_every_state_tensor_read_as_the_engine_had_it(fx):
    _check_against_truth(fx.ckpt, fx, world=fx.meta["dp_world_size"], stage=fx.meta["stage"])


@pytest.mark.parametrize("fx", OK, ids=IDS)
def test_to_fp32_exact(fx, tmp_path):
    from dsckpt import to_fp32

    out = tmp_path / "m.safetensors"
    to_fp32(fx.ckpt, out)
    got, truth = load_file(str(out)), _truth(fx)
    for n in fx.meta["params"]:
        assert torch.equal(got[n], truth[f"param/{n}"]), n


def _targets(fx: Fixture) -> list[tuple[int, int | None]]:
    """(world, stage) pairs each fixture is resharded to: other sizes at its own stage, and the other ZeRO stages
    the optimizer's layout allows (Muon's whole-param momentum exists at ZeRO-1/2 only)."""
    stage, world = fx.meta["stage"], fx.meta["dp_world_size"]
    out: list[tuple[int, int | None]] = [(w, None) for w in (1, 3) if w != world]
    others = [s for s in (1, 2, 3) if s != stage and not (fx.name.startswith("muon") and s == 3)]
    out += [(2 if world != 2 else 3, s) for s in others[:1]]
    return out


@pytest.mark.parametrize("fx", OK, ids=IDS)
def test_reshard_keeps_every_state_tensor(fx, tmp_path):
    targets = _targets(fx)
    for world, stage in targets:
        out = _reshard(fx.ckpt, tmp_path / f"w{world}s{stage}", world, stage)
        _check_against_truth(out, fx, world=world, stage=stage if stage is not None else fx.meta["stage"])
    # and back from the last one (another stage where the optimizer allows): the source's own layout again
    back = _reshard(out, tmp_path / "back", fx.meta["dp_world_size"], fx.meta["stage"])
    _check_against_truth(back, fx, world=fx.meta["dp_world_size"], stage=fx.meta["stage"])


@pytest.mark.parametrize("name", sorted(REFUSED))
def test_refused_by_name(name):
    fx = next((f for f in ALL if f.name == name), None)
    if fx is None:
        pytest.skip(f"{name} not generated")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    with pytest.raises(UnsupportedCheckpointError, match=REFUSED[name]):
        read_source_facts(ckpt, cache)


# --- live: real DeepSpeed loads the resharded outputs ----------------------------------------------------------

LIVE_WORLD = 3


def _write_tampered(fx: Fixture, out: Path) -> None:
    """``fx`` resharded to LIVE_WORLD ranks with rank 0's first per-element state of group 0 shifted by one element:
    the check must report it, or it could not see a misplaced state."""
    import dataclasses

    from dsckpt.ds_writers.plan import RangeCopy

    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    plan = plan_reshard(ckpt, LIVE_WORLD, facts=read_source_facts(ckpt, cache))
    r0 = plan.ranks[0]
    (key, spec), *rest = r0.groups[0].states
    c = spec.copies[0]
    moved = dataclasses.replace(spec, copies=(RangeCopy(c.file, c.key, c.src_offset + 1, c.numel - 1, c.dst_offset),
                                              *spec.copies[1:]))
    g0 = dataclasses.replace(r0.groups[0], states=((key, moved), *rest))
    r0 = dataclasses.replace(r0, groups=(g0, *r0.groups[1:]))
    run_reshard(dataclasses.replace(plan, ranks=(r0, *plan.ranks[1:])), out, cache=cache, verify="none")


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_every_optimizer_resharded(tmp_path):
    """One launch on LIVE_WORLD ranks: DeepSpeed's plain load_checkpoint() of each CPU fixture resharded to that size
    (same config) restores every state tensor, master, group step and hyper-parameter bit for bit and runs one more
    step (tests/ds_reshard_check.py check_optim); a tampered control fails."""
    from ds_launch import DEEPSPEED, passed_except_controls, run_check_script

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    from ds_launch import jit_op_built

    # DeepSpeedCPULion runs DeepSpeed's JIT-built cpu_lion op: only where it is built (or DSCKPT_JIT_LIVE=1)
    cpu = [f for f in OK if f.meta.get("device", "cpu") == "cpu"
           and (f.meta.get("base_optimizer") != "DeepSpeedCPULion" or jit_op_built("cpu_lion"))]
    if not cpu:
        pytest.skip("no optimizer fixture")
    pairs = [f"optim/{fx.name}={_reshard(fx.ckpt, tmp_path / fx.name, LIVE_WORLD)}" for fx in cpu]
    control = next(f for f in cpu if f.name.startswith("sgd"))
    _write_tampered(control, tmp_path / "tampered")
    pairs.append(f"optim/{control.name}={tmp_path / 'tampered'}")
    _, results, log = run_check_script("ds_reshard_check.py", pairs, world=LIVE_WORLD, cwd=tmp_path, timeout=1500)
    results, controls = passed_except_controls(results, log)
    assert {r["fixture"] for r in results} == {f"optim/{f.name}" for f in cpu}
    assert len(controls) == 1 and not controls[0]["ok"], controls
    assert any("differs from the source" in m for m in controls[0]["problems"]), controls[0]["problems"]


@pytest.mark.parametrize("key, why", [("worker_error", "error-feedback buffer sized by the world size"),
                                      ("exp_avg_sq_row", "factored second moment")])
def test_state_not_per_element_refused_by_name(tmp_path, key, why):
    """A state tensor that is neither a scalar nor one value per element (1-bit Adam's error feedback, Adafactor's
    factored moments), planted into a copy of a real save: reshard refuses it by name, nothing written."""
    import shutil

    from dsckpt import parsed_tree, safe_load, safe_save

    fx = next(f for f in OK if f.name == "sgd_s2_fp32_w2")
    src = tmp_path / "ckpt"
    shutil.copytree(fx.ckpt, src)
    path = src / fx.meta["tag"] / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    tree = parsed_tree.materialize(safe_load.load(path))
    tree["optimizer_state_dict"]["base_optimizer_state"]["state"][0][key] = torch.zeros(5)
    safe_save.save(tree, path)
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    with pytest.raises(UnsupportedCheckpointError, match=f"optimizer state '{key}' of shape \\[5\\]: an? {why}"):
        read_source_facts(ckpt, cache)
    assert not (tmp_path / "out").exists()


# FusedLamb and DeepSpeedCPULion keep each group's step as a Python int: step.pt holds it so, as ds_to_universal's does
INT_STEP = [f for f in OK if f.name.startswith(("lamb", "lion"))]
UNIVERSAL_OK = [f for f in OK if not f.name.startswith("muon")]


@pytest.mark.parametrize("fx", UNIVERSAL_OK, ids=[f.name for f in UNIVERSAL_OK])
def test_universal_folder_keeps_every_state(fx, tmp_path):
    """reshard --universal: one zero/<param>/<key>.pt per per-element state (DeepSpeed's universal loader reads every
    <key>.pt of the folder), step.pt only where the group keeps a step; re-read, every state equals the truth."""
    from dsckpt.reshard import plan_universal_reshard, run_universal

    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    plan = plan_universal_reshard(ckpt, read_source_facts(ckpt, cache))
    run_universal(plan, tmp_path / "u", cache=cache)
    ucache = FileCache()
    u = read_checkpoint(tmp_path / "u", cache=ucache)
    truth, keys = _truth(fx), _state_keys(fx)
    steps = {n: g["step"] for g in fx.meta["groups"] for n in g["names"]}
    for n in fx.meta["trainable"]:
        e = u.entry(n)
        assert sorted(e.state_keys) == sorted(keys[n])  # one file per key: the folder records no order
        assert torch.equal(read_copy(e, ucache, Role.MASTER), truth[f"param/{n}"]), n
        for k in keys[n]:
            assert torch.equal(read_copy(e, ucache, k), truth[f"{k}/{n}"].float()), (n, k)
        step_file = tmp_path / "u" / f"{fx.meta['tag']}_universal" / "zero" / n / "step.pt"
        assert step_file.exists() == (steps[n] is not None and fx.meta["stage"] != 3), n
        if step_file.exists():  # the step as the optimizer kept it: a Python int for FusedLamb/DeepSpeedCPULion
            saved = torch.load(step_file, weights_only=True)
            assert type(saved) is (int if fx in INT_STEP else torch.Tensor), (n, saved)
            assert saved == steps[n], (n, saved, steps[n])
    assert u.optimizer_step == ckpt.optimizer_step, (u.optimizer_step, ckpt.optimizer_step)


def test_muon_refused_where_no_rewrite_exists(tmp_path):
    """Muon's whole-param momentum exists at ZeRO-1/2 only: ZeRO-3 and universal targets are refused by name."""
    from dsckpt.reshard import plan_universal_reshard

    fx = next((f for f in OK if f.name.startswith("muon")), None)
    if fx is None:
        pytest.skip("no Muon fixture")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    facts = read_source_facts(ckpt, cache)
    with pytest.raises(UnsupportedCheckpointError, match="Muon"):
        plan_reshard(ckpt, 2, zero_stage=3, facts=facts)
    with pytest.raises(UnsupportedCheckpointError, match="Muon param groups"):
        plan_universal_reshard(ckpt, facts)
