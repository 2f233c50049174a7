"""ZeRO-1/2 ``zero_optimization.elastic_checkpoint`` saves: what reshard writes from them, what it refuses, and
(live) DeepSpeed resuming the rewrite.

The generic fixture tests read both elastic fixtures (``s2_bf16_w2_elastic``, ``s1_fp32_w2_elastic``) like every
other one, and ``test_reshard*.py`` round-trip them to 1-4 ranks and between ZeRO-1 and ZeRO-2.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import all_fixtures, ids, parsed_file, tree_digest

from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, plan_universal_reshard, read_source_facts, run_reshard

ELASTIC = [f for f in all_fixtures() if f.elastic]
INVENT = "its optimizer files keep each param group's state but not the param groups themselves"


def reshard(src: Path, out: Path, world: int, stage: int | None = None):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world, zero_stage=stage, facts=read_source_facts(ckpt, cache))
    return run_reshard(plan, out, cache=cache, verify="full")


def test_both_fixtures_exist():
    assert sorted(f.name for f in ELASTIC) == ["s1_fp32_w2_elastic", "s2_bf16_w2_elastic"]


@pytest.mark.parametrize("fx", ELASTIC, ids=ids(ELASTIC))
@pytest.mark.parametrize("world", [1, 3])
def test_reshard_writes_the_elastic_layout(fx, world, tmp_path):
    """Elastic -> elastic at another size and the other ZeRO stage (1 <-> 2), checked on the raw files, not through
    dsckpt's reader: per rank a list of per-group states as long as the rank's stored fp32 partition (padding
    stripped), no param groups, the step in ``base_optimizer_state_step``; the lean moments concatenated over the
    ranks and cut by ``param_shapes`` are the truth DeepSpeed's API gave at save time."""
    stage = 3 - fx.meta["stage"]
    reshard(fx.ckpt, tmp_path / "out", world, stage)
    tag_dir = tmp_path / "out" / fx.meta["tag"]
    ms = parsed_file(tag_dir / "mp_rank_00_model_states.pt")
    assert ms["dp_world_size"] == world
    assert ms["ds_config"]["zero_optimization"] == {**fx.meta["config"]["zero_optimization"], "stage": stage}
    prefix = "bf16_" if fx.meta["dtype"] == "bf16" else ""
    osds = [parsed_file(tag_dir / f"{prefix}zero_pp_rank_{r}_mp_rank_00_optim_states.pt")["optimizer_state_dict"]
            for r in range(world)]
    truth = fx.truth()
    for r, osd in enumerate(osds):
        base = osd["base_optimizer_state"]
        assert isinstance(base, list) and len(base) == len(ms["param_shapes"])
        assert osd["base_optimizer_state_step"] == 3 and int(osd["zero_stage"]) == stage
        for g, st in enumerate(base):
            assert list(st) == ["step", "exp_avg", "exp_avg_sq"] and float(st["step"]) == 3.0
            stored = osd["single_partition_of_fp32_groups"][g].numel()
            assert st["exp_avg"].shape == st["exp_avg_sq"].shape == (stored,), (r, g)
            assert stored + osd["group_paddings"][g] == osds[0]["single_partition_of_fp32_groups"][g].numel() \
                + osds[0]["group_paddings"][g]
    checked = 0
    for g, shapes in enumerate(ms["param_shapes"]):
        flat = {k: torch.cat([osd["base_optimizer_state"][g][k] for osd in osds]) for k in ("exp_avg", "exp_avg_sq")}
        flat["param"] = torch.cat([osd["single_partition_of_fp32_groups"][g] for osd in osds])
        off = 0
        for name, shape in shapes.items():
            n = shape.numel()
            for k, t in flat.items():
                assert torch.equal(t[off:off + n].view(shape), truth[f"{k}/{name}"]), (k, name)
                checked += 1
            off += n
    assert checked == 3 * 7


@pytest.mark.parametrize("fx", ELASTIC, ids=ids(ELASTIC))
def test_other_targets_refused_by_name(fx, tmp_path):
    """Every target that would store param groups (ZeRO-3, stage 0, a universal folder, another TP size, a DCP
    folder) is refused up front, saying why; the CLI exits 3 and writes nothing."""
    ckpt = read_checkpoint(fx.ckpt)
    for kwargs, target in (({"zero_stage": 3}, "ZeRO stage 3"), ({"zero_stage": 0}, "ZeRO stage 0"),
                           ({"tp_size": 2}, "tensor parallel size 2")):
        with pytest.raises(UnsupportedCheckpointError, match=f"elastic_checkpoint save\\) to {target}: {INVENT}"):
            plan_reshard(ckpt, 2, **kwargs)
    with pytest.raises(UnsupportedCheckpointError, match=f"to a universal checkpoint \\(--universal\\): {INVENT}"):
        plan_universal_reshard(ckpt)
    before = tree_digest(fx.ckpt)
    for args in (["reshard", "--world-size", "2", "--zero-stage", "3"], ["reshard", "--universal"], ["to-dcp"]):
        res = CliRunner().invoke(main, [args[0], str(fx.ckpt), str(tmp_path / "out"), *args[1:]])
        assert res.exit_code == 3, res.output
        assert "would have to invent them" in res.stderr and res.stdout == ""
        assert not (tmp_path / "out").exists()
    assert tree_digest(fx.ckpt) == before


def test_elastic_files_without_the_elastic_config_refused():
    """The list of per-group states is what the files say; a ds_config that does not set elastic_checkpoint
    contradicts them, and reshard refuses rather than guess which one holds."""
    fx = ELASTIC[0]
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    cfg = {**ckpt.ds_config, "zero_optimization": {"stage": ckpt.zero_stage}}
    with pytest.raises(UnsupportedCheckpointError, match="does not set zero_optimization.elastic_checkpoint"):
        read_source_facts(dataclasses.replace(ckpt, ds_config=cfg), cache)


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_resumes_elastic_resharded(tmp_path):
    """One launch on 3 ranks, with each fixture's own config (elastic_checkpoint true): DeepSpeed's plain
    load_checkpoint() of both fixtures resharded to 3 ranks (and the ZeRO-2 one also to ZeRO-1) restores masters,
    moments, module weights, buffers and the Adam step exactly and runs one more step (tests/ds_reshard_check.py); a
    tampered control fails; and DeepSpeed's own 2-rank save is refused at 3 ranks by its world-size check."""
    from ds_launch import DEEPSPEED, run_check_script
    from test_optim import _write_tampered

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    pairs = []
    for fx in ELASTIC:
        reshard(fx.ckpt, tmp_path / fx.name, 3)
        pairs.append(f"{fx.name}={tmp_path / fx.name}")
    bf16 = next(f for f in ELASTIC if f.meta["stage"] == 2)
    reshard(bf16.ckpt, tmp_path / "to_zero1", 3, 1)
    pairs.append(f"{bf16.name}@1={tmp_path / 'to_zero1'}")
    _write_tampered(bf16, tmp_path / "tampered")
    pairs.append(f"{bf16.name}={tmp_path / 'tampered'}")
    pairs.append(f"{bf16.name}={bf16.ckpt}")  # DeepSpeed's own save, as it is
    _, results, log = run_check_script("ds_reshard_check.py", pairs, world=3, cwd=tmp_path, timeout=1500)
    assert len(results) == len(pairs), log
    *ours, control, own = results
    assert all(r["ok"] for r in ours), "\n".join(f"{r['fixture']}: {r['problems']}" for r in ours)
    assert not control["ok"] and any("differs from the source" in m for m in control["problems"]), control
    assert not own["ok"] and all("used a DP world size of 2 but the current world size is 3" in m
                                 for m in own["problems"]), own
