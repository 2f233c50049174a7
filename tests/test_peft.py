"""PEFT fine-tunes under the HF Trainer + DeepSpeed (issue 26): info, adapter export, streamed merge, resume.

The fixtures (tests/fixtures/peft/, generate_peft.py) are real Trainer + PEFT 0.21.2 + DeepSpeed 0.19.8 runs on 2
CPU ranks, with PEFT's own ``save_pretrained`` of the fp32 masters (``adapter/``) and ``merge_and_unload()`` on the
saved base (``merged.safetensors``) recorded at generation time. PEFT itself is the oracle in the tests too: the
exported adapter is loaded with ``PeftModel.from_pretrained`` and merged with ``merge_and_unload()`` here, on this
CPU, and dsckpt's merge must equal that bit for bit (same formula, same dtype, same machine). Against the recorded
merge, computed on the machine that generated the fixtures, fp32 outputs get rtol 1e-6 and bf16 outputs one bf16
step (2**-7 relative): ``B @ A`` goes through this CPU's BLAS kernels, whose summation order may differ elsewhere.
"""

from __future__ import annotations

import dataclasses
import json
import os
import sys
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from conftest import FIXTURES, tree_digest
from safetensors.torch import load_file

from dsckpt.cli import main
from dsckpt.errors import UnsupportedCheckpointError
from dsckpt.peft import adapter_key, base_name, plan_merge_actions, read_adapter_config
from dsckpt.readers import read_checkpoint

sys.path.insert(0, str(FIXTURES))
import peft_models as pm

sys.path.remove(str(FIXTURES))

PEFT_DIR = FIXTURES / "peft"


class Fx:
    def __init__(self, name: str) -> None:
        self.name = name
        self.dir = PEFT_DIR / name
        self.ckpt = self.dir / "ckpt"
        self.meta = json.loads((self.dir / "truth.json").read_text())
        self.spec = pm.PEFT_FIXTURES[name]
        self.base = self.dir / self.meta["peft"]["base_dir"]

    def truth(self) -> dict:
        return load_file(str(self.dir / "truth.safetensors"))

    def adapter(self) -> dict:
        return load_file(str(self.dir / "adapter" / "adapter_model.safetensors"))


ALL = [Fx(n) for n in pm.PEFT_FIXTURES]
LORA = [f for f in ALL if f.spec["type"] == "LORA"]
OTHER = [f for f in ALL if f.spec["type"] != "LORA"]
IDS = [f.name for f in ALL]


def _by(name: str) -> Fx:
    return next(f for f in ALL if f.name == name)


def _cli(*args: str):
    return CliRunner().invoke(main, [str(a) for a in args])


def test_every_fixture_is_present_and_was_recorded_by_peft():
    assert sorted(p.name for p in PEFT_DIR.iterdir() if p.is_dir()) == sorted(pm.PEFT_FIXTURES)
    for fx in ALL:
        assert fx.meta["peft"]["version"] == "0.21.2" and fx.meta["ds_version"] == "0.19.8"
        assert (fx.ckpt / "adapter_config.json").is_file() and not (fx.ckpt / "config.json").exists()
        assert "merge_and_unload" in fx.meta["crosscheck"]
    assert _by("peft_llama_lora_z3_bf16_w2_full").meta["crosscheck"]["frozen_base_equals_base_dir"] is True


# ---------------------------------------------------------------------------------------------------------------
# pure: names and config


@pytest.mark.parametrize("name, key", [
    ("base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight",
     "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"),
    ("base_model.model.m.q_proj.lora_magnitude_vector.default.weight", "base_model.model.m.q_proj.lora_magnitude_vector"),
    ("base_model.model.lm_head.modules_to_save.default.weight", "base_model.model.lm_head.weight"),
    ("base_model.model.m.k_proj.ia3_l.default", "base_model.model.m.k_proj.ia3_l"),
    ("base_model.model.m.q_proj.lora_E.default", "base_model.model.m.q_proj.lora_E"),
    ("base_model.model.lm_head.original_module.weight", None),
    ("base_model.model.m.q_proj.base_layer.weight", None),
    ("base_model.model.lm_head.weight", None),
    ("base_model.model.default.q_proj.weight", None),  # a module that happens to be named like the adapter
])
def test_adapter_key_is_peft_save_pretrained_key(name, key):
    assert adapter_key(name) == key


@pytest.mark.parametrize("name, base", [
    ("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight", "model.layers.0.self_attn.q_proj.weight"),
    ("base_model.model.lm_head.original_module.weight", "lm_head.weight"),
    ("base_model.model.model.norm.weight", "model.norm.weight"),
    ("base_model.model.lm_head.modules_to_save.default.weight", None),
    ("model.norm.weight", None),
])
def test_base_name(name, base):
    assert base_name(name) == base


def test_rank_and_alpha_patterns_pick_like_peft():
    from peft.utils.other import get_pattern_key

    cfg = read_adapter_config(_by(pm.LLAMA_LORA).ckpt)
    assert cfg is not None and cfg.variant == "LoRA"
    for module in ("model.layers.0.self_attn.v_proj", "model.layers.1.mlp.down_proj", "model.layers.0.self_attn.q_proj"):
        r = cfg.rank_pattern.get(get_pattern_key(cfg.rank_pattern.keys(), module), cfg.r)
        alpha = cfg.alpha_pattern.get(get_pattern_key(cfg.alpha_pattern.keys(), module), cfg.alpha)
        assert cfg.module_rank_alpha(module) == (r, alpha)
    assert cfg.module_rank_alpha("model.layers.0.self_attn.v_proj") == (2, 8)
    assert cfg.module_rank_alpha("model.layers.0.mlp.down_proj") == (4, 16)


@pytest.mark.parametrize("fx", ALL, ids=IDS)
def test_info_says_it_is_a_peft_run(fx):
    r = _cli("info", fx.ckpt, "--json")
    assert r.exit_code == 0, r.output
    peft = json.loads(r.stdout)["peft"]
    cfg = peft["adapter"]
    assert cfg["type"] == fx.spec["type"]
    want = fx.spec["config"]
    assert cfg["r"] == want.get("r", want.get("init_r"))
    assert sorted(cfg["target_modules"]) == sorted(want["target_modules"])
    assert cfg["modules_to_save"] == want.get("modules_to_save", [])
    assert peft["base_in_checkpoint"] == (fx.spec.get("save") == "full")
    assert peft["adapter_tensors"] == len(fx.meta["peft"]["adapter_keys"])
    variant = {"peft_llama_dora_z3_bf16_w2": "DoRA + rsLoRA", "peft_llama_lora_z3_bf16_w2_full": "rsLoRA",
               "peft_llama_ia3_z2_bf16_w2": "IA3", "peft_llama_adalora_z2_bf16_w2": "AdaLoRA"}.get(fx.name)
    if variant:
        assert cfg["variant"] == variant
    text = _cli("info", fx.ckpt).stdout
    assert "peft         " in text and ("base weights in the checkpoint" in text) == peft["base_in_checkpoint"]


def test_info_and_export_of_gpt2_name_the_tied_param_whose_source_was_excluded(tmp_path):
    """The checkpoint ties lm_head to wte, which the Trainer's save excluded: not an error (issue 26, item 4)."""
    fx = _by("peft_gpt2_lora_z2_bf16_w2")
    ckpt = read_checkpoint(fx.ckpt)
    assert ckpt.excluded_ties == (("base_model.model.lm_head.weight", "base_model.model.transformer.wte.weight"),)
    assert "tied base_model.model.lm_head.weight -> base_model.model.transformer.wte.weight" in _cli(
        "info", fx.ckpt).stdout
    # the raw state dict has it as the Trainer saved it: the bf16 module value (the frozen, tied wte)
    r = _cli("to-fp32", fx.ckpt, tmp_path / "raw.safetensors")
    assert r.exit_code == 0, r.output
    assert "'base_model.model.lm_head.weight' points to 'base_model.model.transformer.wte.weight'" in r.stderr
    raw = load_file(str(tmp_path / "raw.safetensors"))
    base = load_file(str(fx.base / "model.safetensors"))
    assert torch.equal(raw["base_model.model.lm_head.weight"], base["transformer.wte.weight"].bfloat16().float())
    # ZeRO-3 keeps an empty placeholder for the alias: no entry, still no error
    dora = read_checkpoint(_by("peft_llama_dora_z3_bf16_w2").ckpt)
    assert dora.excluded_ties == (("base_model.model.lm_head.weight", "base_model.model.model.embed_tokens.weight"),)
    assert "base_model.model.lm_head.weight" not in {e.name for e in dora.entries}


# ---------------------------------------------------------------------------------------------------------------
# adapter export


def _load_peft(fx: Fx, adapter_dir: Path):
    """PeftModel.from_pretrained(base, adapter_dir) as a user does it, and the adapter keys it did not get."""
    from peft import PeftModel, set_peft_model_state_dict
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(fx.base, dtype=getattr(torch, fx.meta["peft"]["base_dtype"]))
    model = PeftModel.from_pretrained(base, adapter_dir)
    res = set_peft_model_state_dict(model, load_file(str(adapter_dir / "adapter_model.safetensors")))
    # AdaLoRA's ranknum is not saved by PEFT either (deterministic, _get_adapter_state_dict drops it)
    missing = [k for k in res.missing_keys if adapter_key(k) is not None and ".ranknum." not in k]
    return model, missing, list(res.unexpected_keys)


@pytest.mark.parametrize("fx", ALL, ids=IDS)
def test_adapter_export_is_peft_save_pretrained_of_the_fp32_masters(fx, tmp_path):
    before = tree_digest(fx.ckpt)
    out = tmp_path / "adapter"
    r = _cli("to-fp32", fx.ckpt, out)
    assert r.exit_code == 0, r.output
    assert tree_digest(fx.ckpt) == before
    assert "PEFT adapter (" in r.stdout and "from the fp32 masters" in r.stdout
    assert {p.name for p in out.iterdir()} == {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json",
                                              "tokenizer_config.json", "chat_template.jinja"}
    assert (out / "adapter_config.json").read_bytes() == (fx.ckpt / "adapter_config.json").read_bytes()
    got, want = load_file(str(out / "adapter_model.safetensors")), fx.adapter()
    assert sorted(got) == sorted(want) == fx.meta["peft"]["adapter_keys"]
    for k, t in want.items():
        assert got[k].dtype == torch.float32 and torch.equal(got[k], t), k
    # the Trainer's own adapter file holds the same keys, in 16-bit: the masters rounded
    trainer = load_file(str(fx.ckpt / "adapter_model.safetensors"))
    assert sorted(trainer) == sorted(want)
    assert all(torch.equal(got[k].bfloat16(), trainer[k]) for k in trainer)
    model, missing, unexpected = _load_peft(fx, out)
    assert missing == [] and unexpected == []
    truth = fx.truth()
    for n, p in model.named_parameters():
        if f"param/{n}" in truth:
            assert torch.equal(p.detach().float(), truth[f"param/{n}"]), n


def test_adapter_export_dtype_and_raw_state_dict(tmp_path):
    fx = _by(pm.LLAMA_LORA)
    r = _cli("to-fp32", fx.ckpt, tmp_path / "bf16", "--dtype", "bf16", "-q")
    assert r.exit_code == 0, r.output
    got = load_file(str(tmp_path / "bf16" / "adapter_model.safetensors"))
    assert all(torch.equal(got[k], t.bfloat16()) for k, t in fx.adapter().items())
    # the raw state dict, PEFT's in-memory names: a .safetensors OUT, or --no-hf-files
    truth = fx.truth()
    masters = {k.removeprefix("param/"): v for k, v in truth.items() if k.startswith("param/")}
    for args, path in ((("raw.safetensors",), "raw.safetensors"), (("raw", "--no-hf-files"), "raw/model.safetensors")):
        r = _cli("to-fp32", fx.ckpt, *(tmp_path / args[0],), *args[1:], "-q")
        assert r.exit_code == 0, r.output
        raw = load_file(str(tmp_path / path))
        assert sorted(raw) == sorted(masters) and all(torch.equal(raw[k], v) for k, v in masters.items())
    assert sorted(p.name for p in (tmp_path / "raw").iterdir()) == ["model.safetensors"]
    r = _cli("to-fp32", fx.ckpt, tmp_path / "x", "--max-shard-size", "1KB")
    assert r.exit_code == 2 and "adapter is one file" in r.stderr


# ---------------------------------------------------------------------------------------------------------------
# merge


def _peft_merge(fx: Fx, adapter_dir: Path) -> dict:
    model, missing, unexpected = _load_peft(fx, adapter_dir)
    assert not missing and not unexpected
    return {k: v.detach() for k, v in model.merge_and_unload().state_dict().items()}


MERGES = [  # fixture, --base or None (the checkpoint's own frozen base), base format
    (pm.LLAMA_LORA, True), ("peft_llama_dora_z3_bf16_w2", True), ("peft_gpt2_lora_z2_bf16_w2", True),
    ("peft_llama_lora_z3_bf16_w2_full", False), ("peft_llama_lora_z3_bf16_w2_full", True),
]


@pytest.mark.parametrize("name, with_base", MERGES, ids=[f"{n}-{'base' if b else 'own'}" for n, b in MERGES])
def test_merge_equals_peft_merge_and_unload(name, with_base, tmp_path):
    from transformers import AutoModelForCausalLM

    fx = _by(name)
    out = tmp_path / "merged"
    args = ["to-fp32", fx.ckpt, out, "--merge"] + (["--base", fx.base] if with_base else [])
    r = _cli(*args)
    assert r.exit_code == 0, r.output
    assert "merged the " in r.stdout
    got = {}
    for f in out.glob("*.safetensors"):
        got.update(load_file(str(f)))
    assert (out / "adapter_config.json").exists() is False  # else from_pretrained takes the folder for an adapter
    # PEFT on this machine, on the exported adapter: bit for bit
    _cli("to-fp32", fx.ckpt, tmp_path / "adapter", "-q")
    live = _peft_merge(fx, tmp_path / "adapter")
    recorded = load_file(str(fx.dir / "merged.safetensors"))
    tied = {"lm_head.weight"} if fx.spec["arch"] in ("llama", "gpt2") else set()
    assert sorted(got) == sorted(set(recorded) - tied)
    base_dtype = getattr(torch, fx.meta["peft"]["base_dtype"])
    for k, t in got.items():
        assert t.dtype == base_dtype, k
        assert torch.equal(t, live[k]), k
        rtol = 2 ** -7 if t.dtype == torch.bfloat16 else 1e-6
        torch.testing.assert_close(t, recorded[k], rtol=rtol, atol=0, msg=k)
    modules = sum(".lora_A." in n for n in fx.meta["trainable"])
    assert f"{modules} LoRA module(s) merged, {len(fx.spec['config'].get('modules_to_save', []))} modules_to_save" \
        in r.stdout
    if with_base:
        model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
        assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
        assert model.dtype == base_dtype
        cfg = json.loads((out / "config.json").read_text())
        assert cfg["dtype"] == fx.meta["peft"]["base_dtype"]


def test_merge_dtype_shards_and_bin_base_through_the_safe_loader(tmp_path, monkeypatch):
    """--dtype overrides the base's dtype; --max-shard-size gives shards + index; a pytorch_model.bin base is read by
    dsckpt's safe loader, never torch.load."""
    from transformers import AutoModelForCausalLM

    fx = _by("peft_llama_dora_z3_bf16_w2")
    assert (fx.base / "pytorch_model.bin").is_file()

    def refuse(*a, **k):
        raise AssertionError("torch.load called")

    monkeypatch.setattr(torch, "load", refuse)
    out = tmp_path / "m"
    r = _cli("to-fp32", fx.ckpt, out, "--merge", "--base", fx.base, "--dtype", "bf16", "--max-shard-size", "8KB", "-q")
    assert r.exit_code == 0, r.output
    monkeypatch.undo()
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    got = {}
    for f in set(index["weight_map"].values()):
        got.update(load_file(str(out / f)))
    recorded = load_file(str(fx.dir / "merged.safetensors"))
    for k, t in got.items():
        assert t.dtype == torch.bfloat16
        torch.testing.assert_close(t, recorded[k].bfloat16(), rtol=2 ** -7, atol=0, msg=k)
    model, info = AutoModelForCausalLM.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    assert model.lm_head.weight is model.get_input_embeddings().weight


def test_merge_needs_a_base_and_names_base(tmp_path):
    fx = _by(pm.LLAMA_LORA)
    r = _cli("to-fp32", fx.ckpt, tmp_path / "m", "--merge")
    assert r.exit_code == 2 and "--base" in r.stderr and r.stderr.count("\n") == 1
    assert not (tmp_path / "m").exists()
    r = _cli("to-fp32", fx.ckpt, tmp_path / "m", "--base", fx.base)
    assert r.exit_code == 2 and "add --merge" in r.stderr
    r = _cli("to-fp32", fx.ckpt, tmp_path / "m.safetensors", "--merge", "--base", fx.base)
    assert r.exit_code == 2 and "model folder" in r.stderr


@pytest.mark.parametrize("fx", OTHER, ids=[f.name for f in OTHER])
def test_merge_of_other_adapters_is_refused_by_name(fx, tmp_path):
    r = _cli("to-fp32", fx.ckpt, tmp_path / "m", "--merge", "--base", fx.base)
    cfg = read_adapter_config(fx.ckpt)
    assert r.exit_code == 3 and f"is {cfg.variant} (peft_type {fx.spec['type']})" in r.stderr, r.output
    assert "merge_and_unload()" in r.stderr and not (tmp_path / "m").exists()


def test_merge_plan_refuses_what_it_cannot_merge():
    fx = _by(pm.LLAMA_LORA)
    ckpt = read_checkpoint(fx.ckpt)
    cfg = read_adapter_config(fx.ckpt)
    shapes = {"model.layers.0.self_attn.q_proj.weight": (16, 16)}
    with pytest.raises(UnsupportedCheckpointError, match="the base has no 'model.layers.0.mlp.down_proj.weight'"):
        plan_merge_actions(ckpt, cfg, shapes)
    wrong = dataclasses.replace(cfg, rank_pattern={})  # v_proj's rank 2 no longer explained
    base = {n.removeprefix("base_model.model.").replace(".lora_A.default", "").replace(".lora_B.default", ""): (16, 16)
            for n in fx.meta["trainable"]}
    with pytest.raises(UnsupportedCheckpointError, match="gives r=4, the stored lora_A has rank 2"):
        plan_merge_actions(ckpt, wrong, base)


# ---------------------------------------------------------------------------------------------------------------
# Trainer resumes after reshard (slow: real DeepSpeed launches; one per stage in the default run)

# fixture, the world sizes it is resharded through (2 -> 1; 2 -> 1 -> 2), micro batch of the resumed run (the
# global batch of the recorded run: 2 ranks x 2)
# ZeRO-2 2 -> 1 and ZeRO-3 2 -> 1 -> 2 run by default (one launch each, ~25 s and ~45 s on 2 cores); the other
# directions with DSCKPT_PEFT_ALL_RESUMES=1.
_ALL = pytest.mark.skipif(not os.environ.get("DSCKPT_PEFT_ALL_RESUMES"),
                          reason="set DSCKPT_PEFT_ALL_RESUMES=1 for every direction (the default run does one per stage)")
RESUMES = [(pm.LLAMA_LORA, (1,), 4), ("peft_llama_dora_z3_bf16_w2", (1, 2), 2),
           pytest.param(pm.LLAMA_LORA, (1, 2), 2, marks=_ALL), pytest.param("peft_llama_dora_z3_bf16_w2", (1,), 4, marks=_ALL),
           pytest.param("peft_gpt2_lora_z2_bf16_w2", (1,), 4, marks=_ALL)]


@pytest.mark.live
@pytest.mark.deepspeed
@pytest.mark.parametrize("name, worlds, micro_batch", RESUMES,
                         ids=[f"{n}-to-{'-to-'.join(map(str, w))}" for n, w, _ in
                              (r.values if hasattr(r, "values") else r for r in RESUMES)])
def test_trainer_resumes_resharded_peft_checkpoint(name, worlds, micro_batch, tmp_path):
    """Trainer.train(resume_from_checkpoint=OUT) on the resharded PEFT run (the Trainer loads it with
    load_module_strict=False): every rank resumes at step 3 with the saved LoRA fp32 masters and Adam moments, bit
    for bit, and trains to step 6; the first resumed loss equals the uninterrupted run's within 5e-4 (computed by
    another process layout: see tests/test_hf_trainer.py for the tolerance's reason)."""
    from ds_launch import DEEPSPEED, launch_verdict, ranks_done, run_deepspeed

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    fx = _by(name)
    src = fx.ckpt
    for i, world in enumerate(worlds):
        out = tmp_path / f"hop{i}" / "checkpoint-3"
        r = _cli("reshard", src, out, "-n", world, "-q")
        assert r.exit_code == 0, r.output
        assert (out / "adapter_config.json").read_bytes() == (fx.ckpt / "adapter_config.json").read_bytes()
        src = out
    world = worlds[-1]
    report = tmp_path / "report.json"
    proc = run_deepspeed("hf_trainer_check.py", ["--name", name, "--ckpt", str(src), "--report", str(report),
                                                 "--micro-batch", str(micro_batch)],
                         world=world, cwd=tmp_path, timeout=420)
    complete = report.is_file() and not ranks_done(report, world)
    verdict, note = launch_verdict(proc.returncode, complete=complete, failed=False)
    assert verdict == 0, proc.stdout[-3000:] + proc.stderr[-3000:] + note
    rep = json.loads(report.read_text())
    assert rep["world_size"] == world
    for rr in rep["ranks"]:
        assert rr["mismatch"] == [], rr
        assert rr["checked"] == 3 * len(fx.meta["trainable"]), rr
        assert rr["global_step_at_resume"] == 3 and rr["engine_global_steps"] == 3
    assert rep["final_global_step"] == 6
    first = next(e for e in rep["log"] if e["step"] == 4)
    assert first["loss"] == pytest.approx(fx.meta["trainer"]["losses"]["4"], abs=5e-4, rel=0)


@pytest.mark.parametrize("name, with_base", [(pm.LLAMA_LORA, True), ("peft_gpt2_lora_z2_bf16_w2", True),
                                             ("peft_llama_lora_z3_bf16_w2_full", True)])
def test_merge_in_blocks_of_rows_equals_the_whole_tensor_merge(name, with_base, tmp_path, monkeypatch):
    """The streamed merge adds and rounds each LoRA merge a block of rows at a time; with blocks of 3 rows (the
    fixtures' tensors have 16-64 rows) every element still gets PEFT's value, Conv1D (fan_in_fan_out: rows of the
    transposed delta) and a bf16 base included, with the reader 256 bytes ahead of the writer at most."""
    import dsckpt.peft_merge as pmerge

    fx = _by(name)
    args = ["--base", fx.base] if with_base else []
    assert _cli("to-fp32", fx.ckpt, tmp_path / "whole", "--merge", *args, "-q").exit_code == 0
    monkeypatch.setattr(pmerge, "ROW_BLOCK_NBYTES", 3 * 4 * 16)
    monkeypatch.setattr(pmerge, "AHEAD_NBYTES", 256)
    blocks = []
    real = pmerge.merge_lora_delta
    monkeypatch.setattr(pmerge, "merge_lora_delta", lambda w, d: blocks.append(w.shape[0]) or real(w, d))
    r = _cli("to-fp32", fx.ckpt, tmp_path / "rows", "--merge", *args, "-q")
    assert r.exit_code == 0, r.output
    assert max(blocks) <= 3 and len(blocks) > sum(".lora_A." in n for n in fx.meta["trainable"])
    whole, rows = load_file(str(tmp_path / "whole" / "model.safetensors")), load_file(
        str(tmp_path / "rows" / "model.safetensors"))
    assert sorted(whole) == sorted(rows) and all(torch.equal(whole[k], rows[k]) for k in whole)


def test_merge_from_a_sharded_bin_base(tmp_path):
    """pytorch_model-0000X-of-0000N.bin + pytorch_model.bin.index.json, as transformers < 5 saved large models."""
    fx = _by(pm.LLAMA_LORA)
    base = {}
    for f in fx.base.glob("*.safetensors"):
        base.update(load_file(str(f)))
    names = sorted(base)
    half = len(names) // 2
    d = tmp_path / "binbase"
    d.mkdir()
    (d / "config.json").write_bytes((fx.base / "config.json").read_bytes())
    weight_map = {}
    for i, part in enumerate((names[:half], names[half:]), 1):
        fname = f"pytorch_model-{i:05d}-of-00002.bin"
        torch.save({n: base[n] for n in part}, d / fname)
        weight_map.update({n: fname for n in part})
    (d / "pytorch_model.bin.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    for out, b in (("from-bin", d), ("from-st", fx.base)):
        r = _cli("to-fp32", fx.ckpt, tmp_path / out, "--merge", "--base", b, "-q")
        assert r.exit_code == 0, r.output
    a, b = (load_file(str(tmp_path / o / "model.safetensors")) for o in ("from-bin", "from-st"))
    assert sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def test_damaged_adapter_config_is_one_line_exit_3(tmp_path, monkeypatch):
    """A damaged adapter_config.json is one line, exit 3; an oversized one is refused by the small-text budget
    (dsckpt.limits, lowered here to 1 MiB) before it is parsed."""
    import shutil

    fx = _by(pm.LLAMA_LORA)
    ckpt = tmp_path / "ckpt"
    shutil.copytree(fx.ckpt, ckpt)
    monkeypatch.setenv("DSCKPT_LIMITS", "max_text_nbytes=1MiB")
    for content, phrase in ((b"{not json", "cannot read"), (b'{"r": 4}', "has no 'peft_type'"),
                            (b" " * ((1 << 20) + 1), "exceeds dsckpt's read limit max_text_nbytes")):
        (ckpt / "adapter_config.json").write_bytes(content)
        for args in (["info", ckpt], ["to-fp32", ckpt, tmp_path / "o"]):
            r = _cli(*args)
            assert r.exit_code == 3 and phrase in r.stderr and r.stderr.count("\n") == 1, (args, r.output)
    assert not (tmp_path / "o").exists()
