"""dsckpt reshard: library round trips on every fixture, CLI, refusals, and real DeepSpeed resumes."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import (
    all_fixtures,
    assert_no_fsync_writes_the_same_bytes,
    fixtures_where,
    ids,
    tree_digest,
)
from ds_launch import DEEPSPEED, run_check_script

from dsckpt import parsed_tree, safe_load
from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

REPO = Path(__file__).resolve().parent.parent

RESHARDABLE = [f for f in all_fixtures() if f.meta.get("pp_size", 1) == 1
               and (f.ckpt / f.meta["tag"]).is_dir()]
PIPELINE = [f for f in all_fixtures() if f.meta.get("pp_size", 1) > 1]


def pick(**conditions):
    # dense fixtures: the MoE ones keep their expert-parallel size and have their own tests (test_moe.py)
    chosen = [f for f in fixtures_where(**conditions) if f in RESHARDABLE and "moe" not in f.meta]
    if not chosen:
        pytest.skip(f"no fixture with {conditions}")
    return chosen[0]


def reshard(src: Path, out: Path, world_size: int):
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    plan = plan_reshard(ckpt, world_size, facts=read_source_facts(ckpt, cache))
    return plan, run_reshard(plan, out, cache=cache)


@pytest.mark.parametrize("fx", RESHARDABLE, ids=ids(RESHARDABLE))
@pytest.mark.parametrize("world_size", [1, 2, 3, 4])
def test_reshard_round_trip_verifies_and_leaves_input_untouched(fx, world_size, tmp_path):
    before = tree_digest(fx.ckpt)
    if world_size % fx.ep_size:
        with pytest.raises(UnsupportedCheckpointError, match="must divide the new world size; pick a multiple of"):
            reshard(fx.ckpt, tmp_path / "out", world_size)
        assert not (tmp_path / "out").exists() and tree_digest(fx.ckpt) == before
        return
    plan, result = reshard(fx.ckpt, tmp_path / "out", world_size)
    assert tree_digest(fx.ckpt) == before
    assert (tmp_path / "out" / "latest").read_text() == fx.meta["tag"]
    assert result.verified_tensors > 0
    back = read_checkpoint(tmp_path / "out")
    assert back.dp_world_size == world_size
    assert back.global_steps == fx.meta["global_steps"]
    expected = fx.expected_fp32()
    from dsckpt.assemble import iter_tensors

    for name, t in iter_tensors(back):
        assert torch.equal(t, expected[name]), name
    if plan.zero_stage in (1, 2, 3):
        n_optim = len(list((tmp_path / "out" / fx.meta["tag"]).glob("*optim_states.pt")))
        assert n_optim == world_size


def _materialized(path: Path):
    return parsed_tree.materialize(safe_load.load(path))


def _same(a, b, where=""):
    if isinstance(a, torch.Tensor):
        assert isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape, where
        assert torch.equal(a, b), where
        assert getattr(a, "__dict__", {}) == getattr(b, "__dict__", {}), where
    elif isinstance(a, dict):
        assert type(a) is type(b) and list(a) == list(b), where
        for k in a:
            _same(a[k], b[k], f"{where}/{k}")
    elif isinstance(a, (list, tuple)) and not isinstance(a, torch.Size):
        assert type(a) is type(b) and len(a) == len(b), where
        for i, (x, y) in enumerate(zip(a, b)):
            _same(x, y, f"{where}/{i}")
    else:
        assert a == b and type(a) is type(b), f"{where}: {a!r} != {b!r}"


@pytest.mark.parametrize("fx", RESHARDABLE, ids=ids(RESHARDABLE))
def test_same_size_reshard_reproduces_deepspeed_files(fx, tmp_path):
    """Resharding to the saved size rewrites every file as DeepSpeed wrote it: scalars, mappings,
    paddings, param groups, stand-in objects. Only stage-3 last-rank padding differs (DeepSpeed
    leaves uninitialised memory there, dsckpt writes zeros), so those tensors are compared unpadded."""
    reshard(fx.ckpt, tmp_path / "out", fx.meta["dp_world_size"])
    tag = fx.meta["tag"]
    for f in sorted((fx.ckpt / tag).glob("*.pt")):
        a, b = _materialized(f), _materialized(tmp_path / "out" / tag / f.name)
        if fx.elastic and "optimizer_state_dict" in a and "base_optimizer_state_step" not in a["optimizer_state_dict"]:
            # the one key dsckpt adds to an elastic save (ds_writers.zero12._with_elastic_step: DeepSpeed's elastic
            # load asserts it): the groups' step, right after base_optimizer_state
            osd = b["optimizer_state_dict"]
            assert list(osd).index("base_optimizer_state_step") == list(osd).index("base_optimizer_state") + 1
            assert osd.pop("base_optimizer_state_step") == fx.meta["optimizer_step"][0] == 3
        if fx.meta["stage"] == 3:
            for tree in (a, b):
                osd = tree.get("optimizer_state_dict")
                if osd is not None:
                    osd["fp32_flat_groups"] = ["compared unpadded by the round-trip test"] * len(
                        osd["fp32_flat_groups"])
                if tree.get("frozen_param_fragments"):
                    tree["frozen_param_fragments"] = {k: v.numel() for k, v in tree["frozen_param_fragments"].items()}
        _same(a, b, f.name)


def test_reshard_refuses_pipeline_parallel_without_zero(tmp_path):
    """Pipeline runs reshard (tests/test_reshard_pipeline.py), except without ZeRO, where fp32 keeps the optimizer
    state in each stage's mp_rank_XX_model_states.pt, which is not read."""
    if not PIPELINE:
        pytest.skip("no pipeline fixture")
    cache = FileCache()
    ckpt = replace(read_checkpoint(PIPELINE[0].ckpt, cache=cache), zero_stage=0, optimizer_wrapper="none")
    with pytest.raises(UnsupportedCheckpointError, match="a pipeline run without ZeRO or BF16_Optimizer"):
        read_source_facts(ckpt, cache)
    with pytest.raises(UnsupportedCheckpointError, match="a pipeline run without ZeRO or BF16_Optimizer"):
        plan_reshard(ckpt, 2)


@pytest.mark.parametrize("optimizer", ["OneBitAdam", "ZeroOneAdam", "OneBitLamb"])
def test_reshard_refuses_one_bit_optimizers(optimizer):
    """1-bit optimizers keep error-feedback buffers sized by the world size: refused by name (every optimizer whose
    state is per element is resharded: tests/test_optim.py)."""
    fx = pick(stage=2)
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    with pytest.raises(UnsupportedCheckpointError, match=f"optimizer type '{optimizer}'.*sized by the world size"):
        read_source_facts(replace(ckpt, optimizer_type=optimizer), cache)


def test_reshard_refuses_to_write_into_input(tmp_path):
    fx = pick(stage=1)
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    plan = plan_reshard(ckpt, 3, facts=read_source_facts(ckpt, cache))
    with pytest.raises(UsageError, match="overlaps the input"):
        run_reshard(plan, fx.ckpt / "resharded", cache=cache)


def test_cli_reshard_dry_run_and_run(tmp_path):
    fx = pick(stage=2, dtype="bf16")
    runner = CliRunner()
    out = tmp_path / "out"
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(out), "--world-size", "3", "--dry-run"])
    assert r.exit_code == 1, r.output
    assert "to 3 ranks" in r.stdout and "rank 2:" in r.stdout and "<- " in r.stdout
    assert not out.exists()
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(out), "-n", "3", "-q"])
    assert r.exit_code == 0, r.output
    assert r.stdout.startswith("resharded ") and "verified" in r.stdout
    assert r.stderr == ""
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(out), "-n", "3"])
    assert r.exit_code == 2 and "already exists" in r.stderr
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(out), "-n", "0"])
    assert r.exit_code == 2


def test_cli_reshard_unsupported_exits_3(tmp_path):
    if not PIPELINE:
        pytest.skip("no pipeline fixture")
    fx = next(f for f in PIPELINE if f.name == "pp2_fp32")  # a partition method that does not give its stages
    r = CliRunner().invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "o"), "-n", "4", "--pp-size", "4",
                                  "--partition-method", "parameters", "--num-layers", "7"])
    assert r.exit_code == 3
    assert "does not give the source's 2 stages" in r.stderr and "\n" not in r.stderr.strip()


# --- real DeepSpeed --------------------------------------------------------------------------------

# target world size -> (fixture, chain of world sizes before it). One launch per target size.
# *_cpuforced: fp16 fixtures saved by DeepSpeed on CPU with fp16 forced on (generate.py --force-cpu-fp16);
# the check script forces the same so that fp16 engines (dynamic loss scaler) load them on CPU.
DS_CASES: dict[int, list[tuple[str, tuple[int, ...]]]] = {
    1: [("s2_fp32_w4", ()), ("s3_bf16_w3_subgroups", ()), ("s1_bf16_w2_bf16opt", ()), ("s3_fp16_w2_cpuforced", ())],
    2: [("s1_bf16_w3", ()), ("s3_bf16_w3_subgroups", ()), ("s2_fp32_w3_align", ()), ("s0_fp32_w1", ()),
        ("s1_fp16_w3_cpuforced", ())],
    3: [("s1_fp32_w2", ()), ("s2_bf16_w2_2groups", ()), ("s2_bf16_w2_roundrobin", ()), ("s3_fp32_w2", ()),
        ("s2_fp16_w2_cpuforced", ())],
    4: [("s3_fp32_w1", ()), ("s2_fp32_w4", (1,)), ("s1_bf16_w3", (1,))],
}



@pytest.fixture(scope="module")
def ds_runs(tmp_path_factory):
    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    base = tmp_path_factory.mktemp("ds_reshard")
    known = {f.name for f in all_fixtures()}
    runs = {}
    for world, cases in DS_CASES.items():
        pairs = []
        for name, chain in cases:
            if name not in known:
                continue
            src = REPO / "tests" / "fixtures" / name / "ckpt"
            for i, step in enumerate((*chain, world)):
                out = base / f"for{world}_{name}_{i}_to{step}"
                reshard(src, out, step)
                src = out
            pairs.append(f"{name}={src}")
        fp16 = ["--force-cpu-fp16"] if any("fp16" in p for p in pairs) else []
        runs[world] = run_check_script("ds_reshard_check.py", pairs, args=fp16, world=world, cwd=base, timeout=900)
    return runs


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("world", sorted(DS_CASES), ids=lambda w: f"to{w}")
def test_deepspeed_resumes_resharded_checkpoints(ds_runs, world):
    rc, results, log = ds_runs[world]
    assert results, log
    failed = [r for r in results if not r["ok"]]
    assert not failed, "\n".join(f"{r['fixture']}: {r['problems']}" for r in failed)
    assert rc == 0, log
    expected = {n for n, _ in DS_CASES[world] if n in {f.name for f in all_fixtures()}}
    assert {r["fixture"] for r in results} == expected


# --- the streaming writer and verification -------------------------------------------------------


def test_resharded_files_are_valid_zips_that_torch_loads(tmp_path):
    import zipfile

    fx = pick(stage=2, dtype="bf16")
    reshard(fx.ckpt, tmp_path / "out", 3)
    files = sorted((tmp_path / "out" / fx.meta["tag"]).glob("*.pt"))
    assert files
    for f in files:
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None, f.name
        theirs = torch.load(f, map_location="cpu", weights_only=False)  # torch's own zip reader
        ours = _materialized(f)
        if "optimizer_state_dict" in ours:
            for a, b in zip(ours["optimizer_state_dict"]["single_partition_of_fp32_groups"],
                            theirs["optimizer_state_dict"]["single_partition_of_fp32_groups"]):
                assert torch.equal(a, b), f.name
        else:
            assert theirs["dp_world_size"] == 3
            for k, v in ours["module"].items():
                assert torch.equal(v, theirs["module"][k]), k


def test_zip64_records_load_and_verify(tmp_path, monkeypatch):
    """Sizes and offsets past 4 GiB use zip64 fields: force them on a small fixture."""
    import zipfile

    from dsckpt.assemble import iter_tensors
    from dsckpt.writers import torch_stream

    monkeypatch.setattr(torch_stream, "_ZIP64_LIMIT", 100)
    fx = pick(stage=3)
    _, result = reshard(fx.ckpt, tmp_path / "out", 2)
    assert result.verified_tensors > 0
    for f in sorted((tmp_path / "out" / fx.meta["tag"]).glob("*.pt")):
        with zipfile.ZipFile(f) as z:
            assert z.testzip() is None, f.name
        torch.load(f, map_location="cpu", weights_only=False)
    expected = fx.expected_fp32()
    for name, t in iter_tensors(read_checkpoint(tmp_path / "out")):
        assert torch.equal(t, expected[name]), name


@pytest.mark.parametrize("mode", ["quick", "full"])
def test_verification_catches_misplaced_bytes(mode, tmp_path, monkeypatch):
    """A writer bug that shifts one source range by one element must not reach the output."""
    from dsckpt.ds_writers import common, zero3, zero12
    from dsckpt.errors import CorruptCheckpointError
    from dsckpt.writers.torch_stream import Extent, StreamedTensor

    real = common.streamed

    def shifted(spec, cache, attrs=None, **kw):
        t = real(spec, cache, attrs, **kw)
        ext = [e for e in t.extents if e.path is not None]
        if t.numel < 16 or not ext:
            return t
        bad = tuple(Extent(e.path, e.file_offset + 4, e.nbytes) if e is ext[-1] else e for e in t.extents)
        return StreamedTensor(t.dtype, t.shape, bad, t.attrs)

    monkeypatch.setattr(zero12, "streamed", shifted)
    monkeypatch.setattr(zero3, "streamed", shifted)
    fx = pick(stage=2, dtype="bf16")
    cache = FileCache()
    ckpt = read_checkpoint(fx.ckpt, cache=cache)
    plan = plan_reshard(ckpt, 3, facts=read_source_facts(ckpt, cache))
    with pytest.raises(CorruptCheckpointError, match="verification failed: .* differs in elements"):
        run_reshard(plan, tmp_path / "out", cache=cache, verify=mode)
    assert not (tmp_path / "out").exists()


def test_cli_reshard_verify_modes(tmp_path):
    fx = pick(stage=1)
    runner = CliRunner()
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "a"), "-n", "2", "-q", "--verify", "full"])
    assert r.exit_code == 0, r.output
    assert "(full)" in r.stdout and r.stderr == ""
    r = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "b"), "-n", "2", "-q", "--no-verify"])
    assert r.exit_code == 0, r.output
    assert "verified" not in r.stdout


@pytest.mark.parametrize("stage", [2, 3])
def test_cli_reshard_no_fsync_writes_the_same_files_without_fsync(tmp_path, monkeypatch, stage):
    """The default fsyncs every output file (and the folder) before the rename; --no-fsync writes the
    very same bytes, still through the rename, and says that it did not fsync."""
    fx = pick(stage=stage)
    assert_no_fsync_writes_the_same_bytes(tmp_path, monkeypatch, ["reshard", str(fx.ckpt), "-n", "3"])
