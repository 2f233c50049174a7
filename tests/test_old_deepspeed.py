"""Checkpoints of older DeepSpeed releases (0.10.3, 0.14.5, 0.16.9, 0.18.9).

Default suite: the committed ``ds<ver>_*`` fixtures cover every release in
``fixture_models.OLD_DS_RELEASES`` at stages 0-3 (less the runs ``OLD_DS_NOT_RUN`` names), and the
release differences the readers handle are pinned here by value. Exact reads of each old fixture by
info / to-fp32 / scan / verify / reshard / diff / repair come from the suite's tests parametrized over
``conftest.all_fixtures()``, which includes them.

Opt-in (``olddeepspeed`` marker): checkpoints resharded by dsckpt load in the release that wrote them.

    DSCKPT_OLD_DS_VENVS=/work/venvs pytest -m olddeepspeed tests/test_old_deepspeed.py

Skipped unless ``DSCKPT_OLD_DS_VENVS`` names a folder holding one venv per release (``LOADER_VENVS``; how
they were made: tests/fixtures/README.md, "Older DeepSpeed releases"). For each release and target world
size, every ``ds<ver>_*`` fixture is resharded with dsckpt (this interpreter), then one
``<venv>/bin/deepspeed --num_gpus N tests/ds_reshard_check.py`` launch loads each result with plain
``engine.load_checkpoint()`` and compares fp32 masters, Adam moments, module weights, frozen params,
buffers and counters with the fixture's truth exactly, then trains one more step.
``DSCKPT_OLD_DS_RESULTS=<file.json>`` also writes every per-fixture result there.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from conftest import FIXTURES, all_fixtures, ids
from ds_launch import run_check_script

from dsckpt import open_checkpoint
from dsckpt.model import Kind, Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import plan_reshard, read_source_facts, run_reshard

REPO = Path(__file__).resolve().parent.parent
VENVS = os.environ.get("DSCKPT_OLD_DS_VENVS")

# release -> venv that loads its checkpoints. DeepSpeed <= 0.15 cannot load_checkpoint under torch >= 2.6
# (torch.load's weights_only default refuses the pickled LossScaler/ZeroStageEnum), so 0.14.5 loads with
# torch 2.2.2; 0.10.3 and 0.12.6 need a torch of their era anyway (they import `log` from
# torch.distributed.elastic); 0.16.9 and 0.18.9 pass weights_only=False and load with torch 2.13.
LOADER_VENVS = {"0.10.3": "ds0103", "0.12.6": "ds0126", "0.14.5": "ds0145t222", "0.16.9": "ds0169",
                "0.18.9": "ds0189"}
# target world sizes per release: every fixture to 1 rank, and the 2-rank ones to 3.
TARGETS = (1, 3)

OLD = [f for f in all_fixtures() if f.name.startswith("ds0")]


def _fixture_models():
    import sys

    sys.path.insert(0, str(FIXTURES))
    try:
        import fixture_models
    finally:
        sys.path.remove(str(FIXTURES))
    return fixture_models


# ---------------------------------------------------------------- default suite: what the fixtures cover

def test_every_old_release_has_its_fixtures_written_by_itself():
    fm = _fixture_models()
    assert len(fm.OLD_DS_RELEASES) >= 4
    assert all(v.startswith(("0.10.", "0.11.", "0.12.", "0.13.", "0.14.", "0.15.", "0.16.", "0.17.", "0.18."))
               for v in fm.OLD_DS_RELEASES)
    want = {f"{fm.old_ds_prefix(v)}_{b}" for v in fm.OLD_DS_RELEASES for b in fm.OLD_DS_RUNS
            if (v, b) not in fm.OLD_DS_NOT_RUN}
    want |= {f"{fm.old_ds_prefix(v)}_{b}" for v in fm.OLD_DS_GPU_RELEASES for b in fm.OLD_DS_GPU_RUNS}
    assert {f.name for f in OLD} == want
    for fx in OLD:
        release = fm.FIXTURES[fx.name]["ds"]
        assert fx.meta["ds_version"] == release, fx.name
        # what the files themselves say, not only what the generator recorded
        assert open_checkpoint(fx.ckpt).logical.ds_version == release, fx.name
    for v in fm.OLD_DS_RELEASES:
        cpu = [f for f in OLD if f.meta["ds_version"] == v and f.meta["device"] == "cpu"]
        # DeepSpeed 0.10.3 and 0.12.6 cannot train at stage 0 on CPU (fixture_models.OLD_DS_NOT_RUN says why)
        assert {f.meta["stage"] for f in cpu} == ({1, 2, 3} if v in ("0.10.3", "0.12.6") else {0, 1, 2, 3}), v
        assert {f.meta["dtype"] for f in cpu} == {"fp32", "bf16"}, v
        gpu = [f for f in OLD if f.meta["ds_version"] == v and f.meta["device"] == "cuda"]
        if v in fm.OLD_DS_GPU_RELEASES:
            assert {(f.meta["stage"], f.meta["dtype"]) for f in gpu} == {(s, "fp16") for s in range(4)}, v
        else:
            assert not gpu, v


def test_support_matrix_lists_every_old_release():
    fm = _fixture_models()
    page = (REPO / "docs" / "support-matrix.md").read_text()
    matrix = page[page.index("## DeepSpeed releases verified"):]
    for v in fm.OLD_DS_RELEASES:
        assert f"\n| {v} |" in matrix, v


def _bn_buffer_dtypes(fx) -> dict[str, str]:
    c = open_checkpoint(fx.ckpt)
    return {e.name: e.stored_dtype for e in c.entries if e.kind is Kind.BUFFER and e.name.startswith("bn.running")}


@pytest.mark.parametrize("fx", [f for f in OLD if f.meta["dtype"] == "bf16"],
                         ids=ids([f for f in OLD if f.meta["dtype"] == "bf16"]))
def test_old_releases_store_bn_buffers_in_bf16_and_they_read_exactly(fx):
    """DeepSpeed <= 0.18.9 casts the whole module, buffers included, to bf16 (0.19.8 keeps them fp32)."""
    assert _bn_buffer_dtypes(fx) == {"bn.running_mean": "bfloat16", "bn.running_var": "bfloat16"}
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    for name in ("bn.running_mean", "bn.running_var"):
        got = c.tensor(name)
        assert got.dtype == torch.bfloat16 and torch.equal(got, truth[f"buffer/{name}"]), name


def test_current_release_keeps_bn_buffers_fp32():
    """The contrast that makes the test above mean something: DeepSpeed 0.19.8, same model, bf16."""
    fx = next(f for f in all_fixtures() if f.name == "s1_bf16_w3")
    assert _bn_buffer_dtypes(fx) == {"bn.running_mean": "float32", "bn.running_var": "float32"}


@pytest.mark.parametrize(("name", "wrapper", "layout"), [
    ("ds0145_s0_bf16_w2", "BF16_Optimizer", "stage0-bf16-optimizer"),
    ("ds0169_s0_bf16_w2", "BF16_Optimizer", "stage0-bf16-optimizer"),
    ("ds0189_s0_bf16_w2", "FP16_UnfusedOptimizer", None),
    ("s0_bf16_w2", "FP16_UnfusedOptimizer", None),
])
def test_stage0_bf16_wrapper_by_release(name, wrapper, layout):
    """Stage-0 bf16: BF16_Optimizer (partitioned, ZeRO-1 files) up to 0.16.9, FP16_UnfusedOptimizer from 0.18.9."""
    fx = next(f for f in all_fixtures() if f.name == name)
    c = open_checkpoint(fx.ckpt).logical
    assert fx.meta["optimizer_wrapper"] == wrapper
    assert c.zero_stage == 0
    assert c.optimizer_wrapper == wrapper
    if layout is not None:
        assert c.layout == layout
    optim_files = sorted(p.name for p in c.files if "optim_states" in p.name)
    assert optim_files == (["bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt",
                            "bf16_zero_pp_rank_1_mp_rank_00_optim_states.pt"] if layout else [])


HELD = [f for f in all_fixtures() if f.meta.get("frozen_in_optimizer")]


def test_frozen_params_held_by_the_stage0_unfused_optimizer_are_the_ones_expected():
    """FP16_UnfusedOptimizer of 0.14.5-0.18.9 keeps the requires_grad=False params it is given; 0.19.8 drops them."""
    assert sorted(f.name for f in HELD) == ["ds0145_s0_fp16_w1", "ds0169_s0_fp16_w1", "ds0189_s0_bf16_w2",
                                            "ds0189_s0_fp16_w1"]
    contrast = next(f for f in all_fixtures() if f.name == "s0_bf16_w2")  # 0.19.8, same run
    assert contrast.meta["optimizer_wrapper"] == "FP16_UnfusedOptimizer"
    assert contrast.meta.get("frozen_in_optimizer", []) == []
    assert not open_checkpoint(contrast.ckpt).logical.entry("frozen.weight").trainable


@pytest.mark.parametrize("fx", HELD, ids=ids(HELD))
def test_frozen_params_held_by_an_old_stage0_optimizer_have_masters(fx):
    """They get fp32 masters, zero moments, and a master moved by the zero-grad init step's weight decay. The
    file cannot say they were frozen, so they read as optimizer-owned, with the master the release holds."""
    held = fx.meta["frozen_in_optimizer"]
    assert held == ["frozen.weight", "frozen.bias"]
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    for name in held:
        assert c.logical.entry(name).trainable
        master = c.tensor(name, role=Role.MASTER)
        lowp = truth[f"lowp/{name}"]
        assert torch.equal(master, truth[f"param/{name}"])
        # weight decay (0.01 x lr 1e-2) in the init step: the master is no longer the 16-bit value ...
        assert not torch.equal(master, lowp.float())
        assert torch.equal(master.to(lowp.dtype), lowp)  # ... but still rounds to it
        assert torch.equal(c.tensor(name, state="exp_avg"), torch.zeros_like(master))


# ---------------------------------------------------------------- opt-in: load in the release that wrote them

needs_venvs = [
    pytest.mark.olddeepspeed,
    pytest.mark.skipif(not VENVS, reason="set DSCKPT_OLD_DS_VENVS to the folder of the old-DeepSpeed venvs"),
]


def reshard(src: Path, out: Path, world_size: int) -> None:
    cache = FileCache()
    ckpt = read_checkpoint(src, cache=cache)
    run_reshard(plan_reshard(ckpt, world_size, facts=read_source_facts(ckpt, cache)), out, cache=cache)


def _needs_ipex_shim(venv: Path) -> bool:
    """DeepSpeed <= 0.13 refuses DS_ACCELERATOR=cpu without intel_extension_for_pytorch."""
    src = next(venv.glob("lib/python*/site-packages/deepspeed/accelerator/real_accelerator.py"), None)
    return src is not None and "CPU_Accelerator requires intel_extension_for_pytorch" in src.read_text()


def _cases() -> list[tuple[str, int]]:
    releases = sorted({f.meta["ds_version"] for f in OLD})
    return [(v, w) for v in releases for w in TARGETS]


@pytest.fixture(scope="module")
def results_file():
    results: list[dict] = []
    yield results
    out = os.environ.get("DSCKPT_OLD_DS_RESULTS")
    if out:
        Path(out).write_text(json.dumps(results, indent=1) + "\n")


@needs_venvs[0]
@needs_venvs[1]
@pytest.mark.parametrize(("release", "world"), _cases(), ids=lambda x: str(x))
def test_old_release_loads_resharded(tmp_path, results_file, release, world):
    venv = Path(VENVS or "") / LOADER_VENVS.get(release, "?")
    if not (venv / "bin" / "deepspeed").exists():
        pytest.skip(f"no DeepSpeed {release} venv at {venv}")
    # fp16 ones need a GPU (tests/gpu/check_reshard_fp16.py; results in tests/fixtures/README.md)
    fixtures = [f for f in OLD if f.meta["ds_version"] == release and f.meta["device"] == "cpu"
                and (world == 1 or f.meta["dp_world_size"] > 1)]
    pairs = []
    for fx in fixtures:
        out = tmp_path / f"{fx.name}_to{world}"
        reshard(fx.ckpt, out, world)
        pairs.append(f"{fx.name}={out}")
    # negative control, so that a checker which compares nothing cannot pass: the first fixture once more,
    # resharded, with one fp32 master element moved by 1.0 in the rank-0 file
    control = tmp_path / f"{fixtures[0].name}_to{world}_tampered"
    reshard(fixtures[0].ckpt, control, world)
    _tamper_first_master(control)
    pairs.append(f"{fixtures[0].name}={control}")
    # one torch-extensions cache per release: DeepSpeed's CPU ops (shm_comm) built by one release break another
    ext = Path(os.environ.get("TORCH_EXTENSIONS_DIR", Path.home() / ".cache" / "torch_extensions"))
    env = {"TORCH_EXTENSIONS_DIR": str(ext.parent / f"{ext.name}_{venv.name}"), "PYTHONPATH": str(REPO)}
    if _needs_ipex_shim(venv):
        env["PYTHONPATH"] += os.pathsep + str(REPO / "tests" / "fixtures" / "old_ds_shim")
    rc, got, log = run_check_script("ds_reshard_check.py", pairs, world=world, cwd=tmp_path, timeout=1500,
                                    launcher=venv / "bin" / "deepspeed", env=env)
    assert got, log
    tampered = [r for r in got if r["ckpt"] == str(control)]
    got = [r for r in got if r["ckpt"] != str(control)]
    for r in got:
        src = next(f for f in fixtures if f.name == r["fixture"])
        results_file.append({"release": release, "loaded_with": venv.name, "fixture": r["fixture"],
                             "from_ranks": src.meta["dp_world_size"], "to_ranks": world, "ok": r["ok"],
                             "problems": r["problems"]})
    failed = [r for r in got if not r["ok"]]
    assert not failed, "\n".join(f"{r['fixture']}: {r['problems']}" for r in failed)
    assert {r["fixture"] for r in got} == {f.name for f in fixtures}
    assert len(tampered) == 1 and not tampered[0]["ok"], tampered
    assert any("differs from the source" in m for m in tampered[0]["problems"]), tampered[0]["problems"]
    assert rc == 1, log  # 1: only the control failed


def _tamper_first_master(ckpt: Path) -> None:
    """Add 1.0 to element 0 of the first fp32 master partition that rank 0's files hold (our own output, so a
    trusted full unpickle is fine here)."""
    tag_dir = ckpt / (ckpt / "latest").read_text().strip()
    for f in sorted(tag_dir.glob("*rank_0*_optim_states.pt")) + sorted(tag_dir.glob("mp_rank_00_model_states.pt")):
        sd = torch.load(f, map_location="cpu", weights_only=False)
        osd = sd.get("optimizer_state_dict") or sd.get("optimizer") or {}
        for key in ("single_partition_of_fp32_groups", "fp32_flat_groups", "fp32_groups_flat", "fp32_groups"):
            groups = osd.get(key)
            if groups:
                first = groups[0][0] if isinstance(groups[0], list) else groups[0]
                with torch.no_grad():  # stage-0 fp32_groups masters are saved with requires_grad=True
                    first.view(-1)[0] += 1.0
                torch.save(sd, f)
                return
    raise AssertionError(f"no fp32 master found in {tag_dir}")
