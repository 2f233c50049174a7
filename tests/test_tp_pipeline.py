"""Tensor parallelism x pipeline parallelism (issue 20): the Megatron-DeepSpeed-style PipelineModule fixtures
(``tests/fixtures/tp_pipeline/``, PP 2 x TP 2, layer files ``layer_XX-model_0T-model_states.pt``) against DeepSpeed's
own merge (``universal_truth.safetensors``, ``ds_to_universal``), the live engine's TP-local slices and the pipeline
engine's loss and logits (``truth.safetensors``)."""

from __future__ import annotations

import json
from functools import cache
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner
from scan_helpers import Copy, assert_scan_and_verify_clean, copy_tp_fixture, is_copy, read_copy
from test_reshard import _materialized, _same

from dsckpt import parsed_tree, safe_load, safe_save
from dsckpt.assemble import read_entry
from dsckpt.cli import main
from dsckpt.layout import CheckpointFiles, classify_files, find_tag_dir
from dsckpt.model import Role
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.readers.common import lookup
from dsckpt.readers.pipeline import read_stages, tp_rank_files
from dsckpt.scan import scan

FIX_DIR = Path(__file__).parent / "fixtures"
PP_DIR = FIX_DIR / "tp_pipeline"
FIXTURES = sorted(p.parent for p in PP_DIR.glob("*/truth.json"))
IDS = [p.name for p in FIXTURES]
ROLE_KEY = {Role.MASTER: "fp32", "exp_avg": "exp_avg", "exp_avg_sq": "exp_avg_sq"}
TIED = "tied_modules.embed.word_embeddings.weight"
FP32 = PP_DIR / "megatron_pp2_tp2_z1_fp32"
BF16 = PP_DIR / "megatron_pp2_tp2_z1_bf16_bf16opt"
FROZEN = PP_DIR / "megatron_pp2_tp2_z1_bf16_bf16opt_frozen"


@cache
def meta(fx: Path) -> dict:
    return json.loads((fx / "truth.json").read_text())


@cache
def _load(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path))


def frozen(fx: Path) -> frozenset[str]:
    """The fixture's frozen params (``requires_grad=False``: no master, no optimizer state; truth ``lowp`` only)."""
    return frozenset(meta(fx).get("frozen", []))


def copies(fx: Path) -> int:
    """Stored copies per TP rank: master, two moments and module slice of each trainable param, the module slice of
    each frozen one."""
    return 4 * len(meta(fx)["params"]) - 3 * len(frozen(fx))


def universal(fx: Path) -> dict:
    return _load(fx / "universal_truth.safetensors")


def truth(fx: Path) -> dict:
    return _load(fx / "truth.safetensors")


def _merge_local(name: str, slices: list[torch.Tensor]) -> torch.Tensor:
    """The model's own construction (tp_megatron_models): vocabulary rows past 30 are padding, fc1 is [gate_t; up_t]
    per rank, fc2 is split on dim 1, the rest is replicated."""
    if name == TIED:
        return torch.cat(slices, 0)[:30]
    if name.endswith("fc1.weight"):
        halves = [s.chunk(2, 0) for s in slices]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], 0)
    if name.endswith("fc2.weight"):
        return torch.cat(slices, 1)
    return slices[0]


def test_fixtures_are_what_the_tests_assume():
    assert IDS == ["megatron_pp2_tp2_z1_bf16_bf16opt", "megatron_pp2_tp2_z1_bf16_bf16opt_frozen",
                   "megatron_pp2_tp2_z1_fp32"]
    # frozen: one split and one replicated param on each stage (row-parallel fc2 and replicated ln.bias on stage 0,
    # the fused fc1 and replicated fc2.bias on stage 1), none in the optimizer
    assert meta(FROZEN)["frozen"] == ["1.ln.bias", "1.fc2.weight", "2.fc1.weight", "2.fc2.bias"]
    assert meta(FROZEN)["crosscheck"]["frozen_outside_optimizer"]
    for fx in FIXTURES:
        m = meta(fx)
        assert (m["pp_size"], m["tp_size"], m["dp_world_size"]) == (2, 2, 1)
        assert [(r["stage"], r["tp"], r["mp_rank"]) for r in m["rank_map"]] == [(0, 0, 0), (0, 1, 1), (1, 0, 2),
                                                                                 (1, 1, 3)]
        assert m["crosscheck"]["live_merge_equals_ds_to_universal"]["ok"]
        assert m["crosscheck"]["tied_copies_equal_across_stages"]
        assert "layer_02-model_01-model_states.pt" in {Path(f).name for f in m["files"]}


def test_tp_rank_files_maps_model_parallel_ranks_pipe_major():
    """Pure: PP 2 x TP 2 x DP 2 file names -> TP rank t's plain pipeline view (model-parallel rank m = stage * 2 + t,
    as PipeModelDataParallelTopology numbers them; layer files of model_0t only)."""
    tag = Path("/x/global_step1")
    ms = {m: tag / f"mp_rank_{m:02d}_model_states.pt" for m in range(4)}
    optim = {(d, m): tag / f"zero_pp_rank_{d}_mp_rank_{m:02d}_optim_states.pt" for d in range(2) for m in range(4)}
    layers = {(layer, t): tag / f"layer_{layer:02d}-model_{t:02d}-model_states.pt" for layer in range(4) for t in range(2)}
    files = CheckpointFiles(root=tag.parent, tag=tag.name, tag_dir=tag, mp_to_model_states=ms,
                            dp_mp_to_zero3_model_states={}, dp_mp_to_optim_states=optim, bf16_prefixed_optim=False,
                            layer_files=layers, other_files=())
    view = tp_rank_files(files, 1, 2)
    assert {s: p.name for s, p in view.mp_to_model_states.items()} == {0: "mp_rank_01_model_states.pt",
                                                                        1: "mp_rank_03_model_states.pt"}
    assert {k: p.name for k, p in view.dp_mp_to_optim_states.items()} == {
        (0, 0): "zero_pp_rank_0_mp_rank_01_optim_states.pt", (1, 0): "zero_pp_rank_1_mp_rank_01_optim_states.pt",
        (0, 1): "zero_pp_rank_0_mp_rank_03_optim_states.pt", (1, 1): "zero_pp_rank_1_mp_rank_03_optim_states.pt"}
    assert {k: p.name for k, p in view.layer_files.items()} == {
        (layer, None): f"layer_{layer:02d}-model_01-model_states.pt" for layer in range(4)}
    assert view.mp_world_size == 2 and view.optim_dp_world_size == 2


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_to_fp32_is_bit_identical_to_deepspeed_merge(fx, tmp_path):
    out = tmp_path / "m.safetensors"
    r = CliRunner().invoke(main, ["to-fp32", str(fx / "ckpt"), str(out)])
    assert r.exit_code == 0, r.output
    got, u, tr = _load(out), universal(fx), truth(fx)
    assert sorted(got) == sorted(meta(fx)["params"])
    for n in meta(fx)["params"]:  # a frozen param: its module slices merged, upcast
        want = (_merge_local(n, [tr[f"tp{t}/lowp/{n}"] for t in range(2)]).float() if n in frozen(fx)
                else u[f"fp32/{n}"])
        assert got[n].dtype == torch.float32 and torch.equal(got[n], want), n


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_moments_and_layer_file_copies_merge_exactly(fx):
    """Adam moments equal ds_to_universal's; the layer files' module copies, merged, equal the live engine's TP-local
    params merged by the model's construction; the optimizer step is the engine's."""
    cache_ = FileCache()
    ckpt = read_checkpoint(fx / "ckpt", cache=cache_)
    m = meta(fx)
    assert (ckpt.pp_world_size, ckpt.tp_world_size, ckpt.dp_world_size) == (2, 2, 1)
    assert ckpt.optimizer_wrapper == m["optimizer_wrapper"] and ckpt.optimizer_step == 3
    assert [e.name for e in ckpt.entries if e.tied_to is None] == m["params"]
    u, tr = universal(fx), truth(fx)
    for n in m["params"]:
        e = ckpt.entry(n)
        assert list(e.shape) == m["full_shapes"][n]
        assert e.trainable == (n not in frozen(fx)), n
        for role, key in ROLE_KEY.items() if e.trainable else ():
            assert torch.equal(read_copy(e, cache_, role), u[f"{key}/{n}"]), (role, n)
        assert e.trainable or {p.role for p in e.pieces} == {Role.MODULE}, n
        lowp = _merge_local(n, [tr[f"tp{t}/lowp/{n}"] for t in range(2)])
        got = read_entry(e, cache_, Role.MODULE)
        assert got.dtype == lowp.dtype and torch.equal(got, lowp), n
    cache_.finish_checks()


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_export_reproduces_pipeline_engine_loss_and_logits(fx, tmp_path):
    """to-fp32's output loaded into the plain (TP 1, no pipeline) model gives the pipeline engine's logits and loss
    on the recorded batch: within 1e-5 at fp32 (another reduction order: TP all-reduce, CPU), and at bf16 within two
    bf16 ulps of the largest logit after casting the model to bf16 as the engine ran."""
    import sys

    sys.path.insert(0, str(FIX_DIR))
    try:
        import tp_megatron_models as mm
    finally:
        sys.path.remove(str(FIX_DIR))

    out = tmp_path / "m.safetensors"
    assert CliRunner().invoke(main, ["to-fp32", str(fx / "ckpt"), str(out)]).exit_code == 0
    got = _load(out)
    model = mm.MegatronNet(None, 0, 1).eval()
    missing, unexpected = model.load_state_dict(
        {plain: got[n] for n, plains in mm.pipe_to_plain_names().items() for plain in plains}, strict=True)
    assert not missing and not unexpected
    tr = truth(fx)
    if meta(fx)["dtype"] == "bf16":
        model = model.to(torch.bfloat16)
    with torch.no_grad():
        logits = model(tr["input_ids"]).float()
    want = tr["logits"]
    tol = 1e-5 if meta(fx)["dtype"] == "fp32" else 2 * 2.0 ** -7 * float(want.abs().max())
    assert float((logits - want).abs().max()) <= tol
    loss = mm.pipe_loss(logits, tr["input_ids"])
    assert abs(float(loss) - float(tr["loss"][0])) <= (1e-5 if meta(fx)["dtype"] == "fp32" else 5e-3)  # 2.4e-7, 2.5e-4


def test_info_shows_pipeline_and_tensor_sizes():
    r = CliRunner().invoke(main, ["info", "--json", str(BF16 / "ckpt")])
    assert r.exit_code == 0, r.output
    s = json.loads(r.stdout)
    assert (s["dp_world_size"], s["pp_world_size"], s["tp_world_size"]) == (1, 2, 2)
    assert (s["layout"], s["zero_stage"], s["optimizer_wrapper"]) == ("pipeline", 1, "BF16_Optimizer")
    assert s["tensor_parallel"]["tp_size"] == 2
    split = {t["name"]: t["tp_split"] for t in s["tensors"]}
    assert split[TIED] == "vocabulary dim 0 (16/16, 30 rows kept)"
    assert split["1.fc1.weight"] == "sub-params dim 0 (12/12, 2 sub-params)"
    assert split["2.fc2.weight"] == "row dim 1 (6/6)" and split["2.fc2.bias"] == "replicated"
    assert split["3.weight"] == "replicated"
    r = CliRunner().invoke(main, ["info", str(BF16 / "ckpt")])
    assert "parallelism  data 1, pipeline 2, tensor 2" in r.stdout
    assert "BF16_Optimizer" in r.stdout


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_scan_and_verify_clean(fx):
    assert_scan_and_verify_clean(fx / "ckpt")


def _set_local(ckpt: Path, tp_rank: int, name: str, role: Copy, local_index: int, value: float,
               replica: int = 0) -> Path:
    """Set element ``local_index`` of TP rank ``tp_rank``'s local slice (``replica`` 1: a tied param's stage-1 copy),
    located by the plain pipeline reader of that TP rank's files alone (no TP mapping involved); returns the file
    changed."""
    root, tag, tag_dir = find_tag_dir(ckpt, None)
    local = read_stages(tp_rank_files(classify_files(root, tag, tag_dir), tp_rank, 2), FileCache())
    assert local.tp_world_size == 1 and local.pp_world_size == 2
    piece = next(p for p in local.entry(name).pieces if is_copy(p, role, replica))
    f = next(f for f in piece.fragments if f.dst_offset <= local_index < f.dst_offset + f.numel)
    tree = parsed_tree.materialize(safe_load.load(f.file))
    lookup(tree, f.key, f.file).view(-1)[f.src_offset + local_index - f.dst_offset] = value
    safe_save.save(tree, f.file)
    return f.file


@pytest.mark.parametrize("name, role, local_rc, cols, full_index, where", [
    # row-parallel 2.fc2.weight (8, 12), stage 1: TP rank 1's local (3, 5) is full (3, 6 + 5); fp32 master in the
    # stage-1 / TP-1 optimizer file (model-parallel rank 3)
    ("2.fc2.weight", Role.MASTER, (3, 5), 6, 3 * 12 + 11, "mp_rank_03"),
    # fused [gate; up] 1.fc1.weight (24, 8), stage 0: TP rank 1's local row 7 is its up-half row 1 -> full row
    # 12 + 6 + 1; the module copy in layer_01's TP-1 file
    ("1.fc1.weight", Role.MODULE, (7, 2), 8, 19 * 8 + 2, "layer_01-model_01"),
])
def test_scan_finds_inf_in_one_slice_at_full_index(tmp_path, name, role, local_rc, cols, full_index, where):
    ckpt = copy_tp_fixture(FP32, tmp_path)
    changed = _set_local(ckpt, 1, name, role, local_rc[0] * cols + local_rc[1], float("inf"))
    assert where in changed.name
    bad = [f for f in scan(ckpt).findings if f.count]
    hit = [f for f in bad if f.name == name]
    assert len(hit) == 1 and hit[0].first_indices == (full_index,) and hit[0].posinf == 1, [f.describe() for f in bad]
    assert where in hit[0].file.name
    r = CliRunner().invoke(main, ["scan", str(ckpt)])
    assert r.exit_code == 1 and name in r.stdout


def test_verify_flips_when_tp_replicas_disagree(tmp_path):
    ckpt = copy_tp_fixture(BF16, tmp_path)
    _set_local(ckpt, 1, "3.weight", Role.MASTER, 2, 0.5)
    r = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.stdout.splitlines() if "3.weight" in ln)
    assert "differs from replica 0 in 1 element(s)" in line and "mp_rank_03" in line


def test_tied_embedding_copy_of_the_last_stage_is_checked(tmp_path):
    """The tied embedding is trained on stage 0 and stage 1 (grads all-reduced): stage 1's optimizer copies are
    replicas of stage 0's. A stage-1 fp32 master that drifted makes verify fail naming the stage-1 / TP-1 file; an
    inf there is found by scan at its full index (TP rank 1's local row 2 is full row 16 + 2)."""
    e = read_checkpoint(FP32 / "ckpt").entry(TIED)
    copies = sorted((p.label, p.replica, p.same_as) for p in e.pieces)
    assert copies == sorted([(r, 0, None) for r in ("master", "exp_avg", "exp_avg_sq", "module")]
                            + [(r, 1, 0) for r in ("master", "exp_avg", "exp_avg_sq")])
    ckpt = copy_tp_fixture(FP32, tmp_path / "drift")
    changed = _set_local(ckpt, 1, TIED, Role.MASTER, 2 * 8 + 3, 0.125, replica=1)
    assert changed.name == "zero_pp_rank_0_mp_rank_03_optim_states.pt"
    r = CliRunner().invoke(main, ["verify", str(ckpt)])
    assert r.exit_code == 1, r.output
    line = next(ln for ln in r.stdout.splitlines() if TIED in ln)
    assert "differs from replica 0 in 1 element(s)" in line and "mp_rank_03" in line
    # to-fp32 keeps the first stage's copy (what ds_to_universal keeps: pipeline_replicated_parameter_patterns)
    out = tmp_path / "m.safetensors"
    assert CliRunner().invoke(main, ["to-fp32", str(ckpt), str(out)]).exit_code == 0
    assert torch.equal(_load(out)[TIED], universal(FP32)[f"fp32/{TIED}"])
    ckpt = copy_tp_fixture(FP32, tmp_path / "inf")
    _set_local(ckpt, 1, TIED, "exp_avg_sq", 2 * 8 + 3, float("inf"), replica=1)
    hit = [f for f in scan(ckpt).findings if f.count and f.name == TIED]
    assert len(hit) == 1 and hit[0].first_indices == ((16 + 2) * 8 + 3,) and hit[0].file.name == changed.name, \
        [f.describe() for f in hit]


def test_diff_export_vs_deepspeed_merge_is_equal(tmp_path):
    from safetensors.torch import save_file

    ref = tmp_path / "ref.safetensors"
    save_file({k[5:]: v.contiguous() for k, v in universal(BF16).items() if k.startswith("fp32/")}, str(ref))
    r = CliRunner().invoke(main, ["diff", str(BF16 / "ckpt"), str(ref)])
    assert r.exit_code == 0, r.output


def _edit_model_states(ckpt: Path, edit) -> None:
    for f in sorted((ckpt / "global_step3").glob("mp_rank_*_model_states.pt")):
        tree = parsed_tree.materialize(safe_load.load(f))
        edit(tree)
        safe_save.save(tree, f)


@pytest.mark.parametrize("edit, names", [
    # no record at all: nothing says how any param is split
    (lambda tree: tree.pop("universal_checkpoint_info"), [TIED, "1.ln.weight"]),
    # a record that says two incompatible things: the fused fc1 (2 sub-params) also a vocabulary param
    (lambda tree: tree["universal_checkpoint_info"]["vocabulary_parameter_patterns"].append(r"\d+.fc1.weight"),
     ["1.fc1.weight", "2.fc1.weight"]),
], ids=["no-record", "contradicting-record"])
def test_params_the_record_does_not_cover_are_refused_by_name(tmp_path, edit, names):
    ckpt = copy_tp_fixture(FP32, tmp_path)
    _edit_model_states(ckpt, edit)
    out = tmp_path / "o.safetensors"
    r = CliRunner().invoke(main, ["to-fp32", str(ckpt), str(out)])
    assert r.exit_code == 3, r.output
    assert len(r.stderr.strip().splitlines()) == 1 and "does not guess splits from shapes" in r.stderr
    assert all(n in r.stderr for n in names), r.stderr
    assert not out.exists()


def test_record_differing_between_model_parallel_ranks_is_refused(tmp_path):
    ckpt = copy_tp_fixture(FP32, tmp_path)
    f = ckpt / "global_step3" / "mp_rank_02_model_states.pt"
    tree = parsed_tree.materialize(safe_load.load(f))
    tree["universal_checkpoint_info"]["padded_vocab_size"] = 34
    safe_save.save(tree, f)
    r = CliRunner().invoke(main, ["info", str(ckpt)])
    assert r.exit_code == 3 and "mp_rank_02_model_states.pt" in r.stderr and "differs" in r.stderr


@pytest.mark.parametrize("gone, named", [
    ("layer_02-model_01-model_states.pt", "layer_02-model_01"),
    ("zero_pp_rank_0_mp_rank_03_optim_states.pt", "(pipeline stage, TP rank (1, 1))"),
    ("mp_rank_03_model_states.pt", "expected mp_rank_00 .. mp_rank_03"),
], ids=["layer-file", "optim-file", "model-states"])
def test_missing_file_of_one_model_parallel_rank_is_named(tmp_path, gone, named):
    ckpt = copy_tp_fixture(FP32, tmp_path)
    (ckpt / "global_step3" / gone).unlink()
    r = CliRunner().invoke(main, ["info", str(ckpt)])
    assert r.exit_code == 3 and named in r.stderr and "interrupted" in r.stderr, r.stderr


# ---------------------------------------------------------------------------------------------- reshard (issue 32)

# the Megatron fixture's PipelineModule: embedding (tied), 2 blocks, final LayerNorm, the tied output head (a
# forward_fn, no file); partition_method type:BlockPipe
LAYER_TYPES = "EmbeddingPipe[embed],BlockPipe,BlockPipe,FinalLayerNorm,EmbeddingPipe[embed]"
TYPED = ["--partition-method", "type:BlockPipe", "--layer-types", LAYER_TYPES]


def _reshard_cli(src: Path, out: Path, *args: str) -> str:
    r = CliRunner().invoke(main, ["reshard", str(src), str(out), "--verify", "full", *args])
    assert r.exit_code == 0, r.output
    return r.stdout


def _stored(e, master: str, module_is_master: bool = False) -> list:
    """``(truth key, piece)`` of each stored copy of ``e``: a trainable param's master (``master`` names its truth
    key; ``module_is_master``: an fp32 stage-0 save's module copy), Adam moments and module copy; a frozen param's
    module copy, the only one it has."""
    if not e.trainable:
        assert {p.role for p in e.pieces} == {Role.MODULE}, e.name
        return [("lowp", e.piece(Role.MODULE))]
    return [(master, e.piece(Role.MODULE if module_is_master else Role.MASTER)), ("exp_avg", e.state_piece("exp_avg")),
            ("exp_avg_sq", e.state_piece("exp_avg_sq")), ("lowp", e.piece(Role.MODULE))]


def _tp_local_truth(out: Path, fx: Path, pp: int, dp: int) -> int:
    """Every TP rank's files of ``out`` (read as a plain pipeline checkpoint of local slices) hold the source engine's
    TP-local fp32 masters, Adam moments and 16-bit slices (truth ``tp{t}/...``) bit for bit, at ``pp`` stages x
    ``dp`` ranks; a frozen param only its 16-bit slice (the layer files)."""
    from dsckpt.assemble import read_piece

    cache_ = FileCache()
    files = classify_files(*find_tag_dir(out, None))
    tr = truth(fx)
    checked = 0
    for t in range(2):
        ckpt = read_stages(tp_rank_files(files, t, 2), cache_)
        assert (ckpt.pp_world_size, ckpt.dp_world_size, ckpt.optimizer_step) == (pp, dp, 3)
        for e in ckpt.entries:
            assert e.trainable == (e.name not in frozen(fx)), e.name
            for key, piece in _stored(e, "param", module_is_master=not ckpt.zero_stage):  # stage 0 fp32: the module
                want = tr[f"tp{t}/{key}/{e.name}"]
                got = read_piece(piece, e.shape, cache_, name=e.name)
                assert got.dtype == (want.dtype if key == "lowp" else torch.float32), (t, key, e.name)
                assert torch.equal(got, want), (t, key, e.name)
                checked += 1
    cache_.finish_checks()
    return checked


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_reshard_changes_data_parallel_and_stages_with_tp_kept(fx, tmp_path):
    """PP 2 x TP 2 x DP 1 -> DP 2 (8 ranks) and -> 1 stage x DP 2: every TP rank's slices, masters and moments equal
    the source engine's (truth), the layer files (one per layer and TP rank) are copied unchanged; and back to the
    source's sizes, every file is DeepSpeed's own, value for value."""
    tag = "global_step3"
    out = _reshard_cli(fx / "ckpt", tmp_path / "dp2", "-n", "8")
    assert "from 4 to 8 ranks (PP 2 x TP 2 x DP 1 -> PP 2 x TP 2 x DP 2)" in out
    assert _tp_local_truth(tmp_path / "dp2", fx, 2, 2) == 2 * copies(fx)
    out = _reshard_cli(fx / "ckpt", tmp_path / "pp1", "-n", "4", "--pp-size", "1", *TYPED)
    assert "(PP 2 x TP 2 x DP 1 -> PP 1 x TP 2 x DP 2)" in out
    assert "PipeModelDataParallelTopology(num_pp=1, num_mp=2, num_dp=2), partition_method='type:BlockPipe'" in out
    assert _tp_local_truth(tmp_path / "pp1", fx, 1, 2) == 2 * copies(fx)
    layer_files = sorted(p.name for p in (fx / "ckpt" / tag).glob("layer_*"))
    assert len(layer_files) == 8
    for out_dir in ("dp2", "pp1"):
        assert sorted(p.name for p in (tmp_path / out_dir / tag).glob("layer_*")) == layer_files
        for f in layer_files:
            _same(_materialized(fx / "ckpt" / tag / f), _materialized(tmp_path / out_dir / tag / f), f)
    _reshard_cli(tmp_path / "dp2", tmp_path / "back_dp", "-n", "4")
    _reshard_cli(tmp_path / "pp1", tmp_path / "back_pp", "-n", "4", "--pp-size", "2", *TYPED)
    want = sorted(p.name for p in (fx / "ckpt" / tag).glob("*.pt"))
    for out_dir in ("back_dp", "back_pp"):
        assert sorted(p.name for p in (tmp_path / out_dir / tag).glob("*.pt")) == want
        for f in want:
            _same(_materialized(fx / "ckpt" / tag / f), _materialized(tmp_path / out_dir / tag / f), f"{out_dir}/{f}")


def test_reshard_writes_an_fp32_tensor_x_pipeline_run_without_zero(tmp_path):
    """fp32 PP 2 x TP 2 x DP 1 -> stage 0 (a torch optimizer per stage and TP rank, mp_rank_{stage * 2 + t}), stages
    kept and -> 1 stage x DP 2: every TP rank's module slices and moments equal the source engine's (truth), the
    layer files copied; back to ZeRO-1 at the source's sizes, every file is DeepSpeed's own, value for value (no
    clip_grad, which no stage-0 file stores)."""
    tag = "global_step3"
    out = _reshard_cli(FP32 / "ckpt", tmp_path / "z0", "-n", "4", "--zero-stage", "0")
    assert "(PP 2 x TP 2 x DP 1 -> PP 2 x TP 2 x DP 1), ZeRO stage 1 -> 0: wrote 12 files" in out
    assert _tp_local_truth(tmp_path / "z0", FP32, 2, 1) == 2 * 4 * 13
    _reshard_cli(FP32 / "ckpt", tmp_path / "z0pp1", "-n", "4", "--zero-stage", "0", "--pp-size", "1", *TYPED)
    assert _tp_local_truth(tmp_path / "z0pp1", FP32, 1, 2) == 2 * 4 * 13
    ms = _materialized(tmp_path / "z0" / tag / "mp_rank_03_model_states.pt")  # stage 1, TP rank 1
    assert ms["module"] is None
    assert ms["optimizer"]["param_groups"][0]["params"] == list(range(len(ms["param_shapes"][0])))
    _reshard_cli(tmp_path / "z0", tmp_path / "back", "-n", "4", "--zero-stage", "1")
    want = sorted(p.name for p in (FP32 / "ckpt" / tag).glob("*.pt"))
    assert sorted(p.name for p in (tmp_path / "back" / tag).glob("*.pt")) == want
    for f in want:
        a, b = _materialized(FP32 / "ckpt" / tag / f), _materialized(tmp_path / "back" / tag / f)
        if "optim_states" in f:
            assert "clip_grad" not in b["optimizer_state_dict"]
            del a["optimizer_state_dict"]["clip_grad"]
        _same(a, b, f)


def _ds_route(fx: Path, key: str, n: str, tp: int, t: int, rows: int = 32) -> torch.Tensor:
    """Param ``n``'s ``key`` ("fp32", "exp_avg", "exp_avg_sq": ds_to_universal's recorded tensor; "lowp": the live
    engine's 16-bit slices merged) as DeepSpeed's universal loader gives it to TP rank ``t`` of ``tp``
    (load_hp_checkpoint_state, DeepSpeed 0.19.8): the vocabulary zero-padded to the model's ``rows``, then torch.chunk
    on the split dim -- each of fc1's 2 sub-params apart, fc2 on dim 1 -- and replicated params whole."""
    full = (_merge_local(n, [truth(fx)[f"tp{r}/lowp/{n}"] for r in range(2)]) if key == "lowp"
            else universal(fx)[f"{key}/{n}"])
    if n == TIED:
        return torch.nn.functional.pad(full, (0, 0, 0, rows - full.shape[0])).chunk(tp, 0)[t]
    if n.endswith("fc1.weight"):
        return torch.cat([h.chunk(tp, 0)[t] for h in full.chunk(2, 0)], 0)
    if n.endswith("fc2.weight"):
        return full.chunk(tp, 1)[t]
    return full


# (label, CLI arguments, stages, TP size, DP size, make_vocab_size_divisible_by): D = 8 pads the 30-row vocabulary to
# 32 at TP 4 (as at TP 2); D = 2 leaves it unpadded at TP 1, D = 16 pads it to 32 there (the TP-1 files' Megatron
# record says which rows are padding)
TP_CHANGES = [("pp2_tp4", ["-n", "8", "--tp-size", "4"], 2, 4, 1, 8),
              ("pp1_tp4", ["-n", "4", "--tp-size", "4", "--pp-size", "1", *TYPED], 1, 4, 1, 8),
              ("pp1_tp4_dp2", ["-n", "8", "--tp-size", "4", "--pp-size", "1", *TYPED], 1, 4, 2, 8),
              ("pp2_tp1_dp2", ["-n", "4", "--tp-size", "1"], 2, 1, 2, 2),
              ("pp2_tp1_dp2_padded", ["-n", "4", "--tp-size", "1"], 2, 1, 2, 16)]


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
@pytest.mark.parametrize(("label", "args", "pp", "tp", "dp", "d"), TP_CHANGES, ids=[c[0] for c in TP_CHANGES])
def test_reshard_changes_the_tp_size_of_a_tensor_x_pipeline_run(fx, label, args, pp, tp, dp, d, tmp_path):
    """PP 2 x TP 2 -> TP 4 (stages kept, or 1 stage; DP 1 or 2): every TP rank's files, read as a plain pipeline
    checkpoint of local slices, hold DeepSpeed's own route's values (:func:`_ds_route`) -- fp32 masters, Adam moments
    and the layer files' 16-bit slices, the vocabulary's padding rows (now on TP rank 3) zero --, a frozen param's
    16-bit slices (its only copy) re-cut like a trainable one's, a layer file per layer and TP rank, and the
    model-states files say the new sizes. Read back whole by dsckpt, every param (frozen included), both moments and
    the step are the source's."""
    from dsckpt.assemble import read_piece

    out = tmp_path / label
    stdout = _reshard_cli(fx / "ckpt", out, *args, "--make-vocab-size-divisible-by", str(d))
    rows = -(-30 // (d * tp)) * (d * tp)  # Megatron's _vocab_size_with_padding
    assert f"(PP 2 x TP 2 x DP 1 -> PP {pp} x TP {tp} x DP {dp})" in stdout
    tag = out / "global_step3"
    assert sorted(p.name for p in tag.glob("layer_*")) == [f"layer_{i:02d}-model_{t:02d}-model_states.pt"
                                                          for i in range(4) for t in range(tp)]
    cache_ = FileCache()
    files = classify_files(*find_tag_dir(out, None))
    checked = 0
    for t in range(tp):
        ckpt = read_stages(tp_rank_files(files, t, tp), cache_)
        assert (ckpt.pp_world_size, ckpt.dp_world_size, ckpt.optimizer_step) == (pp, dp, 3)
        for e in ckpt.entries:
            assert e.trainable == (e.name not in frozen(fx)), e.name
            for key, piece in _stored(e, "fp32"):
                want = _ds_route(fx, key, e.name, tp, t, rows)
                assert torch.equal(read_piece(piece, e.shape, cache_, name=e.name), want), (t, key, e.name)
                checked += 1
            for p in e.pieces:  # the tied embedding's copy on the last stage equals its first
                if p.replica and pp > 1:
                    assert torch.equal(read_piece(p, e.shape, cache_, name=e.name),
                                       _ds_route(fx, "fp32" if p.role is Role.MASTER else p.state_key, e.name, tp, t,
                                                 rows))
    assert checked == tp * copies(fx)
    ms = torch.load(tag / f"mp_rank_{pp * tp - 1:02d}_model_states.pt", weights_only=False)
    assert (ms["mp_world_size"], ms["checkpoint_parallel_dimensions"]) == (pp * tp, {"pp_degree": pp, "tp_degree": tp})
    assert ms["args"]["tensor_model_parallel_size"] == tp and ms["args"]["padded_vocab_size"] == rows
    assert ms["universal_checkpoint_info"]["padded_vocab_size"] == rows  # kept at TP 1 too, as Megatron-DeepSpeed does
    back = read_checkpoint(out, cache=cache_)
    assert (back.pp_world_size, back.tp_world_size or 1, back.dp_world_size, back.optimizer_step) == (pp, tp, dp, 3)
    for n in meta(fx)["params"]:
        e = back.entry(n)
        assert e.trainable == (n not in frozen(fx)), n
        for role, key in (ROLE_KEY.items() if e.trainable else ()):
            assert torch.equal(read_copy(e, cache_, role), universal(fx)[f"{key}/{n}"]), (key, n)
        assert torch.equal(read_entry(e, cache_, Role.MODULE),
                           _merge_local(n, [truth(fx)[f"tp{r}/lowp/{n}"] for r in range(2)])), n
    cache_.finish_checks()


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_tp1_padded_round_trip_of_a_tensor_x_pipeline_run(fx, tmp_path):
    """PP 2 x TP 2 -> PP 2 x TP 1 x DP 2 (D = 16: 32 rows, the record kept) -> PP 2 x TP 2: the TP-1 files read with
    their Megatron record (the padding rows as padding) and re-cut for TP 2, layer files included: every stored copy
    of every TP rank is DeepSpeed's own route's (:func:`_ds_route`) -- the source's real rows, its padding rows
    zero."""
    from dsckpt.assemble import read_piece

    _reshard_cli(fx / "ckpt", tmp_path / "tp1", "-n", "4", "--tp-size", "1", "--make-vocab-size-divisible-by", "16")
    stdout = _reshard_cli(tmp_path / "tp1", tmp_path / "tp2", "-n", "4", "--tp-size", "2",
                          "--make-vocab-size-divisible-by", "16")
    assert "(PP 2 x TP 1 x DP 2 -> PP 2 x TP 2 x DP 1)" in stdout
    cache_ = FileCache()
    files = classify_files(*find_tag_dir(tmp_path / "tp2", None))
    checked = 0
    for t in range(2):
        ckpt = read_stages(tp_rank_files(files, t, 2), cache_)
        for e in ckpt.entries:
            for key, piece in _stored(e, "fp32"):
                want = _ds_route(fx, key, e.name, 2, t)
                assert torch.equal(read_piece(piece, e.shape, cache_, name=e.name), want), (t, key, e.name)
                checked += 1
    assert checked == 2 * copies(fx)


@pytest.mark.parametrize("args", [["--world-size", "4", "--tp-size", "1"], ["--world-size", "8", "--tp-size", "4"]],
                         ids=["tp1", "tp4"])
def test_reshard_tp_change_of_a_tensor_x_pipeline_run_needs_the_divisor(tmp_path, args):
    r = CliRunner().invoke(main, ["reshard", str(FP32 / "ckpt"), str(tmp_path / "o"), *args])
    assert r.exit_code == 3, r.output
    assert "re-pads the vocabulary of tied_modules.embed.word_embeddings.weight" in r.stderr
    assert "pass --make-vocab-size-divisible-by" in r.stderr
    assert not (tmp_path / "o").exists()


@pytest.mark.live
@pytest.mark.deepspeed
def test_deepspeed_loads_a_tensor_x_pipeline_run_at_another_tp_size(tmp_path):
    """One 4-rank launch: PP 2 x TP 2 x DP 1 -> PP 1 x TP 4 x DP 1 (every fixture, the frozen one included; D = 8: 32
    rows as the model pads them at TP 4), loaded by DeepSpeed's PipelineEngine with plain load_checkpoint() in the
    fixture's PipelineModule on PipeModelDataParallelTopology(1, 4, 1): every rank's fp32 master, Adam moments and
    16-bit slices equal the source's merged and cut for TP 4 (padding rows zero) -- a frozen param's 16-bit slice,
    zeroed before the load, as well --, steps as saved, one more train_batch runs. Two controls fail on their rank:
    one fp32 master element of TP rank 3 changed, and one element of TP rank 3's slice of the frozen fused
    2.fc1.weight in its layer file."""
    from ds_launch import DEEPSPEED, passed_except_controls, run_check_script
    from test_reshard_pipeline import _tamper

    if not DEEPSPEED.exists():
        pytest.skip("deepspeed launcher not installed")
    pairs = []
    for fx in FIXTURES:
        _reshard_cli(fx / "ckpt", tmp_path / fx.name, "-n", "4", "--tp-size", "4", "--pp-size", "1", *TYPED,
                     "--make-vocab-size-divisible-by", "8", "-q")
        pairs.append(f"tp_pipeline/{fx.name}@pp1@tp4={tmp_path / fx.name}")
    _reshard_cli(FP32 / "ckpt", tmp_path / "tampered", "-n", "4", "--tp-size", "4", "--pp-size", "1", *TYPED,
                 "--make-vocab-size-divisible-by", "8", "-q")
    tampered = _tamper(tmp_path / "tampered", "zero_pp_rank_0_mp_rank_03_optim_states.pt")
    pairs.append(f"tp_pipeline/{FP32.name}@pp1@tp4={tmp_path / 'tampered'}")
    _reshard_cli(FROZEN / "ckpt", tmp_path / "frozen_tampered", "-n", "4", "--tp-size", "4", "--pp-size", "1", *TYPED,
                 "--make-vocab-size-divisible-by", "8", "-q")
    f = tmp_path / "frozen_tampered" / "global_step3" / "layer_02-model_03-model_states.pt"
    sd = torch.load(f, weights_only=False)
    sd["fc1.weight"].view(-1)[5] += 1.0
    torch.save(sd, f)
    pairs.append(f"tp_pipeline/{FROZEN.name}@pp1@tp4={tmp_path / 'frozen_tampered'}")
    rc, results, log = run_check_script("ds_pipeline_reshard_check.py", pairs, world=4, cwd=tmp_path, timeout=1200)
    results, controls = passed_except_controls(results, log)
    assert len(results) == len(FIXTURES) and rc == 1, log
    problems = {Path(c["ckpt"]).name: str(c["problems"]) for c in controls}
    assert sorted(problems) == ["frozen_tampered", "tampered"], controls
    assert f"TP rank 3: param of {tampered} differs" in problems["tampered"], controls
    assert "TP rank 3: lowp of 2.fc1.weight differs" in problems["frozen_tampered"], controls
    assert "TP rank 0" not in problems["tampered"] + problems["frozen_tampered"], controls


@pytest.mark.parametrize("fx", FIXTURES, ids=IDS)
def test_universal_matches_recorded_ds_to_universal(fx, tmp_path):
    """``reshard --universal`` of a TP x PP run writes what ds_to_universal wrote for it (tests/fixtures/
    ds_to_universal_record.json: the same files, keys, dtypes, shapes and bytes), and that folder reads back (TP x PP
    universal folders hold the merged tensors): to-fp32 of it equals DeepSpeed's merge bit for bit. Frozen params are
    not in it, as ds_to_universal leaves them out (DeepSpeed's universal loader restores the optimizer's params only)."""
    from universal_record import ds_to_universal_differences

    r = CliRunner().invoke(main, ["reshard", str(fx / "ckpt"), str(tmp_path / "u"), "--universal", "-q"])
    assert r.exit_code == 0, r.output
    assert ds_to_universal_differences(fx, tmp_path / "u") == []
    r = CliRunner().invoke(main, ["to-fp32", str(tmp_path / "u"), str(tmp_path / "m.safetensors")])
    assert r.exit_code == 0, r.output
    got, u = _load(tmp_path / "m.safetensors"), universal(fx)
    assert sorted(got) == sorted(set(meta(fx)["params"]) - frozen(fx))
    for n in got:
        assert torch.equal(got[n], u[f"fp32/{n}"]), n


@pytest.mark.live
@pytest.mark.deepspeed
def test_universal_folder_of_a_tp_pipeline_run_reads_as_pipeline_x_tensor(tmp_path):
    """ds_to_universal converts a TP x PP run (its zero/ holds the merged tensors this suite's truth comes from) and
    copies only the mp_rank_{stage * tp + t} files, not the layer files: the folder reads as pipeline 2 x tensor 2
    (not as 4 TP ranks), its trainable params' masters being DeepSpeed's merge."""
    pytest.importorskip("deepspeed")
    import subprocess
    import sys

    out = tmp_path / "u" / "global_step3_universal"
    res = subprocess.run([sys.executable, "-m", "deepspeed.checkpoint.ds_to_universal", "--input_folder",
                          str(FP32 / "ckpt" / "global_step3"), "--output_folder", str(out), "--num_extract_workers",
                          "1", "--num_merge_workers", "1"], check=False, capture_output=True, text=True, timeout=300,
                         env={"DS_ACCELERATOR": "cpu", "PATH": "/usr/bin:/bin"})
    assert res.returncode == 0, res.stderr[-2000:]
    assert sorted(p.name for p in out.glob("*.pt")) == [f"mp_rank_{m:02d}_model_states.pt" for m in range(4)]
    r = CliRunner().invoke(main, ["info", str(out)])
    assert r.exit_code == 0 and "parallelism  data 1, pipeline 2, tensor 2" in r.stdout, r.output
    r = CliRunner().invoke(main, ["to-fp32", str(out), str(tmp_path / "m.safetensors")])
    assert r.exit_code == 0, r.output
    got = _load(tmp_path / "m.safetensors")
    assert sorted(got) == sorted(meta(FP32)["params"])
    assert all(torch.equal(got[n], universal(FP32)[f"fp32/{n}"]) for n in got)


def test_repair_patches_a_layer_file_slice_from_its_master(tmp_path):
    """A bf16 element of TP rank 1's row slice of 2.fc2.weight (stage 1) in its layer file set to inf is repaired from
    the fp32 master in the stage-1 / TP-1 optimizer file: full index 3 * 12 + 6 + 5; the output reads back equal to
    the live engine's module params and scans clean."""
    ckpt = copy_tp_fixture(BF16, tmp_path)
    name = "2.fc2.weight"
    changed = _set_local(ckpt, 1, name, Role.MODULE, 3 * 6 + 5, float("inf"))
    assert changed.name == "layer_02-model_01-model_states.pt"
    out = tmp_path / "out"
    r = CliRunner().invoke(main, ["repair", str(ckpt), str(out), "--from", "master", "-q"])
    assert r.exit_code == 0, r.output
    assert f"{name} (param): 1 of 96 values at [47]" in r.stdout
    cache_ = FileCache()
    fixed = read_checkpoint(out, cache=cache_)
    assert torch.equal(read_entry(fixed.entry(name), cache_, Role.MODULE),
                       _merge_local(name, [truth(BF16)[f"tp{t}/lowp/{name}"] for t in range(2)]))
    assert scan(out).findings == ()
