"""dsckpt info: what is in a checkpoint, checked against what was recorded when it was made."""

from __future__ import annotations

import json
import shutil

import pytest
from click.testing import CliRunner
from conftest import all_fixtures, ids

from dsckpt.cli import main

FIXTURES = all_fixtures()


@pytest.mark.parametrize("fx", FIXTURES, ids=ids(FIXTURES))
def test_info_json_matches_recorded_facts(fx):
    res = CliRunner().invoke(main, ["info", "--json", str(fx.ckpt)])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    s = json.loads(res.stdout)
    m = fx.meta
    assert s["zero_stage"] == m["stage"]
    assert s["precision"] == m["dtype"]
    assert s["dp_world_size"] == m["dp_world_size"]
    assert s["pp_world_size"] == m.get("pp_size", 1)
    assert s["tp_world_size"] == 1
    assert s["deepspeed_version"] == m["ds_version"]
    assert s["global_steps"] == m["global_steps"]
    assert s["global_samples"] == m["global_samples"]
    assert s["tag"] == m["tag"]
    truth = fx.truth()
    unique = [n for n in m["params"] if n not in m.get("tied", {})]
    assert s["params"]["count"] == len(unique)
    assert s["params"]["numel_trainable"] == sum(truth[f"param/{n}"].numel() for n in unique if n in m["trainable"])
    assert s["params"]["numel_frozen"] == sum(truth[f"param/{n}"].numel() for n in unique if n in m["frozen"])
    assert sorted(b["name"] for b in s["buffers"]) == sorted(m["buffers"])
    legacy = fx.name.endswith("_legacy")  # written with "checkpoint_serialization": false
    assert s["health"]["ok"] is True and s["health"]["problems"] == []
    assert [f["crc32"] for f in s["files"]] == [not legacy] * len(s["files"])
    if legacy:
        assert len(s["health"]["notes"]) == 1
        assert s["health"]["notes"][0].startswith("no CRC (legacy format): bit rot cannot be detected in ")
    else:
        assert s["health"]["notes"] == []
    expected_files = sorted(f.split("/", 1)[1] for f in m["files"] if f.startswith(m["tag"] + "/"))
    assert sorted(f["name"] for f in s["files"]) == expected_files
    for f in s["files"]:
        assert f["nbytes"] == (fx.ckpt / m["tag"] / f["name"]).stat().st_size


def test_info_text_names_layout_and_health():
    fx = next(f for f in FIXTURES if f.name == "s3_bf16_w3_subgroups")
    res = CliRunner().invoke(main, ["info", str(fx.ckpt), "--tensors"])
    assert res.exit_code == 0
    out = res.stdout
    assert "ZeRO stage 3 (zero3), bf16" in out
    assert "parallelism  data 3, pipeline 1, tensor 1" in out
    assert "tied         embed.weight = head.weight" in out
    assert "health       ok" in out
    assert "frozen.weight" in out and "frozen" in out


def test_info_reports_inconsistent_partition_as_unhealthy(tmp_path):
    """A stage-3 rank file whose fp32 sub-group is shorter than 'param_shapes' needs is caught."""
    import torch

    from dsckpt import parsed_tree, safe_load, safe_save

    fx = next(f for f in FIXTURES if f.name == "s3_fp32_w2")
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fx.ckpt, ckpt)
    victim = ckpt / fx.meta["tag"] / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    tree = parsed_tree.materialize(safe_load.load(victim))
    groups = tree["optimizer_state_dict"]["fp32_flat_groups"]
    groups[0] = groups[0][:-5].clone()
    safe_save.save(tree, victim)
    res = CliRunner().invoke(main, ["info", str(ckpt)])
    assert res.exit_code == 3
    assert "zero_pp_rank_1_mp_rank_00_optim_states.pt" in res.stderr
    assert "fp32 sub-group 0" in res.stderr
    assert torch.is_tensor(groups[0])


def test_one_element_tensors_read_without_torch_equal_torchs_values():
    # values and types: an int64 counter stays an exact int
    """TensorRef.item() (numpy only: Adam's step, loss scales, counters shown by `info` and checked
    before a reshard) gives torch's value for every one-element tensor of every fixture file."""
    import math

    from dsckpt import parsed_tree, safe_load

    seen: dict[str, int] = {}
    for fx in FIXTURES:
        for path in sorted(fx.ckpt.rglob("*.pt")):
            for _, ref in parsed_tree.walk_tensors(safe_load.load(path)):
                if ref.numel != 1:
                    continue
                want = ref.load().reshape(-1)[0].item()
                got = ref.item()
                assert type(got) is type(want), (path, ref, got, want)
                assert got == want or (math.isnan(got) and math.isnan(want)), (path, ref)
                seen[ref.dtype_name] = seen.get(ref.dtype_name, 0) + 1
    assert seen.get("float32", 0) > 50 and seen.get("int64", 0) > 0, seen


@pytest.mark.parametrize("dtype", ["bfloat16", "float16", "float32", "float64", "int32", "int64", "uint8",
                                   "bool", "complex64", "int64_past_2**53"])
def test_item_of_every_dtype_equals_torch(tmp_path, dtype):
    # the fixtures' one-element tensors are float32 and int64 only; a plain torch.save covers the rest
    import torch

    from dsckpt import safe_load

    special = {"bool": torch.tensor([True]), "complex64": torch.tensor([1.5 - 2j]),
               "int64_past_2**53": torch.tensor([2**53 + 1])}  # a float would round it to 2**53
    t = special.get(dtype, torch.tensor([-3.140625]).to(getattr(torch, dtype, None) or torch.float32))
    torch.save({"x": t, "y": t if dtype in special else torch.tensor(7.25, dtype=getattr(torch, dtype))},
               tmp_path / "s.pt")
    tree = safe_load.load(tmp_path / "s.pt")
    for key in ("x", "y"):
        want = tree[key].load().reshape(-1)[0].item()
        want = want.real if isinstance(want, complex) else want
        got = tree[key].item()
        # integers (bool as 0/1) exactly and as int, like torch's item(); floats as float
        assert got == want and isinstance(got, float) == isinstance(want, float), (got, want)
