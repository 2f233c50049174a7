"""The tensor-parallel fixtures (``tests/fixtures/autotp/``): what DeepSpeed 0.19.8 wrote, pinned against the truth
recorded at generation time, and that ``dsckpt info`` reads them.

These tests read the fixture files with ``torch.load(weights_only=False)``: the fixtures are our own trusted files,
and the point is to pin their layout independently of the reader (phase 2 of the TP issue), not to test
dsckpt's safe loader. The ZeRO arithmetic here is the documented one (tests/fixtures/README.md), written out
plainly; the TP merge follows the ``universal_checkpoint_info`` categories, as ``ds_to_universal`` does.
"""

from __future__ import annotations

import json
import math
import re
import sys
from functools import cache
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dsckpt.cli import main

TP_DIR = Path(__file__).parent / "fixtures" / "autotp"
TP_FIXTURES = sorted(p.parent for p in TP_DIR.glob("*/truth.json"))
TP_IDS = [p.name for p in TP_FIXTURES]
STATES = ("fp32", "exp_avg", "exp_avg_sq")
TRUTH_KIND = {"fp32": "param", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}


@cache
def meta(fx: Path) -> dict:
    return json.loads((fx / "truth.json").read_text())


@cache
def truth(fx: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(fx / "truth.safetensors"))


@cache
def universal(fx: Path) -> dict:
    """DeepSpeed's own merge (``ds_to_universal``) as recorded at generation time. A stage-0 fixture has none:
    ds_to_universal 0.19.8 needs optimizer files ("can't find *_optim_states.pt files", truth.json ``universal``), so
    there it is the generator's own merge of the live TP slices (truth ``param/``, ``exp_avg/``, ``exp_avg_sq/``),
    which equals ds_to_universal's on every fixture that has both (crosscheck ``live_merge_equals_ds_to_universal``)."""
    from safetensors.torch import load_file

    if meta(fx)["stage"] == 0:
        assert meta(fx)["universal"]["rc"] != 0 and "_optim_states.pt" in meta(fx)["universal"]["error"][-1]
        return {f"{s}/{n}": truth(fx)[f"{TRUTH_KIND[s]}/{n}"] for s in STATES for n in meta(fx)["params"]}
    return load_file(str(fx / "universal_truth.safetensors"))


def trainable(fx: Path) -> list[str]:
    """The params the optimizer owns, in ``params`` order: all but the frozen ones (truth.json ``frozen``)."""
    return [n for n in meta(fx)["params"] if n not in meta(fx).get("frozen", ())]


def buffers(fx: Path) -> list[str]:
    """The persistent buffers the model-states files hold (truth.json ``buffers``; older fixtures have none)."""
    return list(meta(fx).get("buffers", ()))


def full_state(fx: Path) -> dict[str, torch.Tensor]:
    """The whole model's state at fp32, full shapes: DeepSpeed's merged fp32 (:func:`universal`) of every trainable
    param; the live module value of each frozen param (truth ``param/``: ds_to_universal writes only TP rank 0's
    local tensor of those) and each buffer (truth ``buffer/``), merged at generation time."""
    u, tr = universal(fx), truth(fx)
    return {**{n: u[f"fp32/{n}"] if n in trainable(fx) else tr[f"param/{n}"] for n in meta(fx)["params"]},
            **{n: tr[f"buffer/{n}"] for n in buffers(fx)}}


def plain_model(fx: Path):
    """The fixture's model without TP (fp32, random init), its frozen params and buffers as the run had them."""
    sys.path.insert(0, str(TP_DIR.parent))
    try:
        if meta(fx)["arch"] == "megatron":
            import tp_megatron_models as mm

            return mm.MegatronNet(None, 0, 1, gqa=meta(fx)["model_config"].get("gqa", False))
        import autotp_models as am

        spec = am.AUTOTP_FIXTURES[fx.name]
        return am.with_frozen_and_buffer(am.make_model(spec["arch"]), spec)
    finally:
        sys.path.remove(str(TP_DIR.parent))


@cache
def load(path: Path) -> dict:
    return torch.load(path, map_location="cpu", weights_only=False)  # trusted fixture (see module docstring)


def tag_dir(fx: Path) -> Path:
    return fx / "ckpt" / meta(fx)["tag"]


def model_file(fx: Path, t: int, d: int = 0) -> Path:
    m = meta(fx)
    if m["stage"] == 3:
        return tag_dir(fx) / f"zero_pp_rank_{d}_mp_rank_{t:02d}_model_states.pt"
    return tag_dir(fx) / f"mp_rank_{t:02d}_model_states.pt"


def optim_file(fx: Path, t: int, d: int) -> Path:
    prefix = "bf16_" if meta(fx)["dtype"] == "bf16" else ""
    return tag_dir(fx) / f"{prefix}zero_pp_rank_{d}_mp_rank_{t:02d}_optim_states.pt"


@cache
def file_slices(fx: Path, t: int) -> dict[str, dict[str, torch.Tensor]]:
    """TP rank t's slice of every param, rebuilt from its DP ranks' optimizer files: state -> name -> tensor."""
    m = meta(fx)
    dp = m["dp_world_size"]
    out: dict = {s: {} for s in STATES}
    if m["stage"] == 0:  # no optimizer files: everything is in mp_rank_0t_model_states.pt
        return stage0_slices(load(model_file(fx, t)))
    if m["stage"] in (1, 2):
        param_shapes = load(model_file(fx, t))["param_shapes"]
        osds = [load(optim_file(fx, t, d))["optimizer_state_dict"] for d in range(dp)]
        for g, shapes in enumerate(param_shapes):
            flat = {
                "fp32": torch.cat([o["single_partition_of_fp32_groups"][g] for o in osds]),
                "exp_avg": torch.cat([o["base_optimizer_state"]["state"][g]["exp_avg"] for o in osds]),
                "exp_avg_sq": torch.cat([o["base_optimizer_state"]["state"][g]["exp_avg_sq"] for o in osds]),
            }
            # BF16_Optimizer files have no param_alignment_paddings (and keep the tail padding of their fp32
            # partitions, which the walk below never reaches).
            pads = osds[0].get("param_alignment_paddings", {g: [0] * len(shapes)})[g]
            offset = 0
            for i, (name, shape) in enumerate(shapes.items()):
                n = math.prod(shape)
                for s in STATES:
                    out[s][name] = flat[s][offset:offset + n].view(tuple(shape))
                offset += n + pads[i]
    else:  # ZeRO-3: each DP rank holds ceil(numel / dp) elements of every param, in param_shapes order
        param_shapes = load(model_file(fx, t, 0))["param_shapes"]
        osds = [load(optim_file(fx, t, d))["optimizer_state_dict"] for d in range(dp)]
        for g, shapes in enumerate(param_shapes):
            flats = [{"fp32": o["fp32_flat_groups"][g],
                      "exp_avg": o["optimizer_state_dict"]["state"][g]["exp_avg"],
                      "exp_avg_sq": o["optimizer_state_dict"]["state"][g]["exp_avg_sq"]} for o in osds]
            offset = 0
            for name, shape in shapes.items():
                n = math.prod(shape)
                part = math.ceil(n / dp)
                for s in STATES:
                    full = torch.cat([f[s][offset:offset + part] for f in flats])[:n]
                    out[s][name] = full.view(tuple(shape))
                offset += part
    return out


def stage0_slices(ms: dict, frozen: tuple[str, ...] = ()) -> dict[str, dict[str, torch.Tensor]]:
    """State -> name -> tensor of a stage-0 model-states file of one of these models (one param group): index ``i``
    of the optimizer side is the ``i``-th module entry that is neither a buffer (``buffer_names``) nor ``frozen``."""
    opt = ms["optimizer"]
    names = [n for n in ms["module"] if n not in (ms.get("buffer_names") or ()) and n not in frozen]
    if "fp32_groups" in opt:  # FP16_UnfusedOptimizer: fp32_groups[0][i] is the i-th param's master
        masters, state = opt["fp32_groups"][0], opt["optimizer_state_dict"]["state"]
    else:  # fp32: the module is the master; torch Adam's state index i is the i-th of model.parameters()
        masters, state = [ms["module"][n] for n in names], opt["state"]
    assert len(masters) == len(names) == len(state)
    return {"fp32": dict(zip(names, masters)),
            **{s: {n: state[i][s] for i, n in enumerate(names)} for s in ("exp_avg", "exp_avg_sq")}}


def matches(patterns: list[str], name: str) -> bool:
    return any(re.match(p, name) for p in patterns)


def merge_by_record(uc: dict, name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """Full tensor from per-TP-rank slices, by the universal_checkpoint_info categories."""
    if matches(uc.get("tp_replicated_parameter_patterns", []), name):
        assert all(torch.equal(slices[0], s) for s in slices[1:]), f"{name}: replicated, but TP ranks differ"
        full = slices[0]
    elif matches(uc.get("parameter_with_2_sub_params_cat_dim_0", []), name):
        halves = [s.chunk(2, dim=0) for s in slices]
        full = torch.cat([torch.cat([h[0] for h in halves]), torch.cat([h[1] for h in halves])])
    elif any(matches(e["patterns"], name) for e in uc.get("parameter_with_sub_params", [])):
        entry = next(e for e in uc["parameter_with_sub_params"] if matches(e["patterns"], name))
        dim = entry["partition_dim"]
        widths = next(w for p, w in uc["sub_param_shard_widths"].items() if re.match(p, name))
        pieces = [list(torch.split(s, [w[t] for w in widths], dim=dim)) for t, s in enumerate(slices)]
        full = torch.cat([pieces[t][k] for k in range(len(widths)) for t in range(len(slices))], dim=dim)
    else:
        dim = 1 if matches(uc.get("parameter_with_row_parallelism_patterns", []), name) else 0
        full = torch.cat(slices, dim=dim)
    if matches(uc.get("vocabulary_parameter_patterns", []), name):
        full = full[: uc["original_vocab_size"]]
    return full


def uc_info(fx: Path) -> dict:
    return load(model_file(fx, 0))["universal_checkpoint_info"]


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_files_per_rank(fx):
    m = meta(fx)
    tp, dp = m["tp_size"], m["dp_world_size"]
    # DeepSpeed copies its zero_to_fp32 scripts only beside ZeRO optimizer files; stage 0 writes none
    want = {"latest"} | (set() if m["stage"] == 0 else {"zero_to_fp32.py", "zero_to_torch.py"})
    if "config.json" in m["files"]:  # the HF config beside the tag folder (the kv6 fixtures, spec "hf_config")
        want.add("config.json")
        assert json.loads((fx / "ckpt" / "config.json").read_text())["num_key_value_heads"] == \
            m["model_config"]["num_key_value_heads"]
    for t in range(tp):
        for d in range(dp):
            if m["stage"] != 0:
                want.add(str(optim_file(fx, t, d).relative_to(fx / "ckpt")))
            want.add(str(model_file(fx, t, d).relative_to(fx / "ckpt")))
    have = {str(p.relative_to(fx / "ckpt")) for p in (fx / "ckpt").rglob("*") if p.is_file()}
    assert have == want == set(m["files"])
    assert (fx / "ckpt" / "latest").read_text() == m["tag"]


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_model_states_record_tp(fx):
    m = meta(fx)
    dp = m["dp_world_size"] if m["stage"] == 3 else 1
    first = uc_info(fx)
    for t in range(m["tp_size"]):
        for d in range(dp):
            sd = load(model_file(fx, t, d))
            assert sd["mp_world_size"] == m["tp_size"]
            assert sd["dp_world_size"] == m["dp_world_size"]
            assert sd["checkpoint_parallel_dimensions"] == {"pp_degree": 1, "tp_degree": m["tp_size"]}
            assert sd["universal_checkpoint_info"] == first  # the same record in every model-states file
    for t in range(m["tp_size"]):
        for d in range(m["dp_world_size"] if m["stage"] else 0):
            osd = load(optim_file(fx, t, d))
            assert "universal_checkpoint_info" not in osd and "universal_checkpoint_info" not in osd[
                "optimizer_state_dict"]
    assert json.loads(json.dumps(first)) == m["universal_checkpoint_info"]  # JSON turned int rank keys to str
    if m["arch"] == "megatron":  # from client_state, as Megatron-DeepSpeed passes it
        sd = load(model_file(fx, 0))
        assert sd["iteration"] == 3 and sd["checkpoint_info"] == {"original_vocab_size": 30, "padded_vocab_size": 32}
        assert "affine_map" not in first
    else:  # AutoTP: every param is in one category, and has an affine map unless replicated by AutoTP's default
        assert first["universal_checkpoint_version"] == 0.4
        assert set(first["affine_map"]["params"]) == {rf"^{re.escape(n)}$" for n in m["params"]}


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_file_slices_are_what_the_engine_returned(fx):
    """Each TP rank's slice in the files equals what safe_get_full_fp32_param / _optimizer_state returned on that
    rank: TP-local tensors (the full shape only for params AutoTP leaves replicated)."""
    m, tr = meta(fx), truth(fx)
    for t in range(m["tp_size"]):
        sl = file_slices(fx, t)
        assert sorted(sl["fp32"]) == sorted(trainable(fx))
        for s in STATES:
            for n in trainable(fx):
                assert torch.equal(sl[s][n], tr[f"tp{t}/{TRUTH_KIND[s]}/{n}"]), (t, s, n)
                assert list(sl[s][n].shape) == m["local_shapes"][f"tp{t}"][n]
    assert set(m["safe_get_full_fp32_param_returns"].values()) <= {"tp_local", "full (replicated param)"}


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_slices_merged_by_record_equal_deepspeed_merge(fx):
    """Concatenating the file slices per the universal_checkpoint_info record reproduces ds_to_universal's fp32 and
    Adam moments exactly, and the live engine's values merged at generation time."""
    m, tr, u = meta(fx), truth(fx), universal(fx)
    uc = uc_info(fx)
    per_rank = [file_slices(fx, t) for t in range(m["tp_size"])]
    split = 0
    for n in trainable(fx):
        for s in STATES:
            full = merge_by_record(uc, n, [r[s][n] for r in per_rank])
            assert torch.equal(full, u[f"{s}/{n}"]), (s, n)
            assert torch.equal(full, tr[f"{TRUTH_KIND[s]}/{n}"]), (s, n)
            assert list(full.shape) == m["full_shapes"][n]
        split += per_rank[0]["fp32"][n].shape != tuple(m["full_shapes"][n])
    assert split > 0


@pytest.mark.parametrize("fx", [f for f in TP_FIXTURES if meta(f)["arch"] != "megatron"],
                         ids=[f.name for f in TP_FIXTURES if meta(f)["arch"] != "megatron"])
def test_affine_map_rebuilds_fp32(fx):
    """AutoTP's affine_map (torch.as_strided offsets/strides per piece) alone rebuilds every param's fp32 -- and a
    frozen param's 16-bit module copy (AutoTP splits and maps it as it does a trainable one), against the live
    engine's values merged at generation time."""
    m, u = meta(fx), universal(fx)
    amap = uc_info(fx)["affine_map"]
    assert amap["version"] == 1
    per_rank = [{**file_slices(fx, t)["fp32"],
                 **{n: load(model_file(fx, t))["module"][n].float() for n in m.get("frozen", ())}}
                for t in range(m["tp_size"])]
    want = {**u, **{f"fp32/{n}": truth(fx)[f"lowp/{n}"].float() for n in m.get("frozen", ())}}
    for n in m["params"]:
        entry = amap["params"][rf"^{re.escape(n)}$"]
        full = torch.full((math.prod(entry["logical_shape"]),), float("nan"))  # NaN: an uncovered element fails
        for rank, spec in entry["ranks"].items():
            # A fresh flat copy: as_strided's offset counts from the start of the storage, and the slice is a view
            # into the whole flat optimizer partition.
            shard = per_rank[int(rank)][n].detach().reshape(-1).clone()
            assert list(per_rank[int(rank)][n].shape) == spec["shard_shape"]
            for pc in spec["pieces"]:
                src_off, src_strides = pc["source"]
                dst_off, dst_strides = pc["dest"]
                full.as_strided(pc["shape"], src_strides, src_off).copy_(
                    shard.as_strided(pc["shape"], dst_strides, dst_off))
        assert torch.equal(full.view(entry["logical_shape"]), want[f"fp32/{n}"]), n


@pytest.mark.parametrize("fx", [f for f in TP_FIXTURES if meta(f)["stage"] < 3],
                         ids=[f.name for f in TP_FIXTURES if meta(f)["stage"] < 3])
def test_module_holds_tp_local_16bit_copy(fx):
    m, tr = meta(fx), truth(fx)
    for t in range(m["tp_size"]):
        module = load(model_file(fx, t))["module"]
        assert [n for n in module if n not in buffers(fx)] == m["params"]
        assert sorted(n for n in module if n in buffers(fx)) == sorted(buffers(fx))
        for n in m["params"]:
            assert torch.equal(module[n], tr[f"tp{t}/lowp/{n}"]), (t, n)
        for n in buffers(fx):  # DeepSpeed >= 0.18 keeps buffers fp32 (no data_types.buffer_dtype)
            assert module[n].dtype == torch.float32 and torch.equal(module[n], tr[f"tp{t}/buffer/{n}"]), (t, n)


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_merged_fp32_reproduces_engine_logits(fx):
    """DeepSpeed's merged fp32 in a plain (non-TP) model gives the engine's logits: to fp32 rounding for fp32
    runs; for bf16 runs within what bf16 compute leaves (engine logits are bf16, upcast)."""
    model, tr = plain_model(fx), truth(fx)
    model.load_state_dict(full_state(fx))
    ids = tr["input_ids"]
    with torch.no_grad():
        out = model.eval()(ids) if meta(fx)["arch"] == "megatron" else model.eval()(input_ids=ids).logits
    diff = float((out.float() - tr["logits"]).abs().max())
    # fp32: another reduction order (TP all-reduce) only; bf16: engine logits carry bf16 rounding (max |logit| < 2).
    tol = 1e-6 if meta(fx)["dtype"] == "fp32" else 0.02
    assert diff <= tol, diff
    assert abs(diff - meta(fx)["crosscheck"]["merged_fp32_logits"]["max_abs_diff_fp32_model"]) < 1e-6


@pytest.mark.parametrize("fx", TP_FIXTURES, ids=TP_IDS)
def test_info_reads_tensor_parallel(fx):
    """Phase 2 of the TP issue: dsckpt reads these folders (it refused them with exit 3 before): tensor size 2, the
    record named, health ok. Values are pinned in tests/test_tensor_parallel.py."""
    res = CliRunner().invoke(main, ["info", str(fx / "ckpt")])
    assert res.exit_code == 0, res.output
    assert res.stderr == ""
    assert f"tensor {meta(fx)['tp_size']}" in res.stdout and f"tensor par.  size {meta(fx)['tp_size']}" in res.stdout
    assert "health       ok" in res.stdout
