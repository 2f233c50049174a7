"""Bind, then prove (issue 8): stage-0 optimizer tensors carry no names; dsckpt binds them only when the
evidence leaves one choice, and refuses what depends on a choice it cannot prove."""

from __future__ import annotations

import itertools
import json

import pytest
import torch
from click.testing import CliRunner
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors.torch import load_file

from conftest import all_fixtures, ids
from dsckpt import open_checkpoint
from dsckpt.binding import AmbiguousBindingError, Slot, order_candidates, resolve
from dsckpt.cli import main
from dsckpt.model import Kind, Role

ADAPTER = [f for f in all_fixtures(include_ambiguous=True) if f.name.startswith("s0_") and "adapter" in f.name]
PROVABLE = [f for f in ADAPTER if not f.expect_ambiguous]
AMBIGUOUS = [f for f in ADAPTER if f.expect_ambiguous]


def test_the_adapter_fixtures_exist():
    assert {f.name for f in PROVABLE} == {
        "s0_fp32_w1_adapter_all", "s0_bf16_w1_adapter", "s0_fp16_w1_adapter_cpuforced",
        "s0_fp16_w1_adapter_fused_cpuforced", "s0_bf16_w1_adapter_fused"}
    assert {f.name for f in AMBIGUOUS} == {"s0_fp32_w1_adapter", "s0_bf16_w1_adapter_ambiguous"}


# ------------------------------------------------------------------------------------------------
# The pure analysis, against brute force


def _brute(slots: list[Slot], cands: list[set[int]], n: int) -> list[tuple[int, ...]]:
    return [perm for perm in itertools.permutations(range(n), len(slots))
            if all(perm[i] in cands[i] for i in range(len(slots)))]


def _ordered_solutions(slots: list[Slot], shapes: list[tuple[int, ...]]) -> set[tuple[int, ...]]:
    out = set()
    for perm in itertools.permutations(range(len(shapes)), len(slots)):
        if not all(s.shape is None or s.shape == shapes[p] for s, p in zip(slots, perm)):
            continue
        if all([p for s, p in zip(slots, perm) if s.group == g] == sorted(p for s, p in zip(slots, perm) if s.group == g)
               for g in {s.group for s in slots}):
            out.add(perm)
    return out


@st.composite
def _instances(draw):  # type: ignore[no-untyped-def]
    n = draw(st.integers(1, 6))
    shapes = [(draw(st.integers(1, 2)),) for _ in range(n)]
    m = draw(st.integers(0, n))
    slots = [Slot(draw(st.integers(0, 1)), i, draw(st.sampled_from([None, (1,), (2,)])), f"s{i}") for i in range(m)]
    return slots, shapes


@settings(derandomize=True, max_examples=400, deadline=None)
@given(_instances())
def test_resolve_proves_exactly_the_slots_every_assignment_agrees_on(inst):
    slots, shapes = inst
    cands = order_candidates(slots, shapes)
    binding = resolve(cands, len(shapes))
    solutions = _brute(slots, cands, len(shapes))
    assert binding.consistent == bool(solutions)
    if not solutions:
        return
    for i in range(len(slots)):
        owners = {sol[i] for sol in solutions}
        if len(owners) == 1:
            assert binding.slot_to_param[i] == owners.pop()
        else:
            assert i in binding.undetermined and i not in binding.slot_to_param
    # Sound: every assignment that keeps each group in module order is among those considered, so a
    # slot proven here is proven for the ordered problem too.
    assert _ordered_solutions(slots, shapes) <= set(solutions)


@settings(derandomize=True, max_examples=300, deadline=None)
@given(_instances())
def test_order_candidates_are_exact_for_one_group(inst):
    slots, shapes = inst
    slots = [Slot(0, s.index, s.shape, s.label) for s in slots]
    truth = _ordered_solutions(slots, shapes)
    cands = order_candidates(slots, shapes)
    for i in range(len(slots)):
        assert cands[i] == ({sol[i] for sol in truth} if truth else cands[i])


def test_the_issue_example_is_ambiguous_by_shape_and_order():
    # frozen Linear(8,8) (weight, bias [8]) before a trainable LayerNorm(8): only trainable params passed
    shapes = [(11, 8), (8, 8), (8,), (8,), (8,), (8, 8), (8,), (11, 8), (11,)]
    slots = [Slot(0, i, s, f"state[{i}]") for i, s in enumerate([(11, 8), (8,), (8,), (8, 8), (8,), (11, 8), (11,)])]
    binding = resolve(order_candidates(slots, shapes), len(shapes))
    assert binding.slot_to_param == {0: 0, 3: 5, 4: 6, 5: 7, 6: 8}
    assert binding.undetermined == (1, 2)


def test_groups_out_of_module_order_are_not_forced_into_it():
    shapes = [(2,), (3,)]
    slots = [Slot(0, 0, (3,), "a"), Slot(0, 1, (2,), "b")]  # one group, listed in reverse module order
    cands = order_candidates(slots, shapes)
    assert not resolve(cands, 2).consistent  # the reader then falls back to shape alone


# ------------------------------------------------------------------------------------------------
# Real DeepSpeed checkpoints: frozen params next to trainable params of equal shape


@pytest.mark.parametrize("fx", PROVABLE, ids=ids(PROVABLE))
def test_frozen_bias_next_to_layernorm_is_bound_by_proof(fx):
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    assert c.logical.ambiguities == ()
    frozen = c.logical.entry("frozen.bias")
    assert not frozen.trainable and not frozen.ambiguous
    assert frozen.piece(Role.MASTER) is None and frozen.state_piece("exp_avg") is None
    for name in ("ln.weight", "ln.bias"):
        e = c.logical.entry(name)
        assert e.trainable
        assert torch.equal(c.tensor(name), truth[f"param/{name}"]), name
        assert torch.equal(c.tensor(name, state="exp_avg"), truth[f"exp_avg/{name}"]), name
        assert torch.equal(c.tensor(name, state="exp_avg_sq"), truth[f"exp_avg_sq/{name}"]), name
    # the shift the shape-greedy reader made: frozen.bias and ln.weight really differ
    assert not torch.equal(truth["param/frozen.bias"], truth["param/ln.weight"])


@pytest.mark.parametrize("fx", AMBIGUOUS, ids=ids(AMBIGUOUS))
def test_info_names_the_ambiguous_params_and_exits_0(fx):
    res = CliRunner().invoke(main, ["info", "--json", str(fx.ckpt)])
    assert res.exit_code == 0, res.output
    s = json.loads(res.stdout)
    (amb,) = s["ambiguities"]
    assert tuple(amb["names"]) == fx.expect_ambiguous
    assert amb["values_agree"] == (fx.meta["dtype"] == "fp32")
    undetermined = {t["name"] for t in s["tensors"] if t["kind"] == "param" and t["trainable"] is None}
    assert undetermined == set(fx.expect_ambiguous)
    truth = fx.truth()
    assert s["params"]["numel_undetermined"] == sum(truth[f"param/{n}"].numel() for n in fx.expect_ambiguous)
    text = CliRunner().invoke(main, ["info", str(fx.ckpt)])
    assert text.exit_code == 0
    assert "binding      AMBIGUOUS for " + ", ".join(fx.expect_ambiguous) in text.stdout


@pytest.mark.parametrize("fx", AMBIGUOUS, ids=ids(AMBIGUOUS))
def test_what_depends_on_the_binding_refuses_with_the_candidates(fx, tmp_path):
    runner = CliRunner()
    res = runner.invoke(main, ["to-fp32", "--exclude-frozen", str(fx.ckpt), str(tmp_path / "o.safetensors")])
    assert res.exit_code == 3
    assert "to-fp32 --exclude-frozen depends on which params own" in res.stderr
    assert "fits frozen.bias or ln.weight" in res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "o.safetensors").exists()
    res = runner.invoke(main, ["reshard", str(fx.ckpt), str(tmp_path / "r"), "-n", "2"])
    assert res.exit_code == 3 and "reshard depends on which params own" in res.stderr, res.output
    assert not (tmp_path / "r").exists()
    with pytest.raises(AmbiguousBindingError):
        list(open_checkpoint(fx.ckpt).iter_tensors(exclude_frozen=True))


def test_fp32_values_do_not_depend_on_the_binding_so_to_fp32_goes_on(tmp_path):
    (fx,) = [f for f in AMBIGUOUS if f.meta["dtype"] == "fp32"]
    out = tmp_path / "o.safetensors"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)])
    assert res.exit_code == 0, res.output
    got, want = load_file(str(out)), fx.expected_fp32()
    assert sorted(got) == sorted(want)
    assert all(torch.equal(got[n], want[n]) for n in want)
    # moments stay attached only where the binding is proven
    c = open_checkpoint(fx.ckpt)
    truth = fx.truth()
    for e in c.logical.entries:
        if e.kind is not Kind.PARAM:
            continue
        if e.name in fx.expect_ambiguous:
            assert e.ambiguous and e.state_piece("exp_avg") is None
        elif e.name in fx.meta["trainable"]:
            assert torch.equal(c.tensor(e.name, state="exp_avg"), truth[f"exp_avg/{e.name}"])


def test_16bit_values_depend_on_the_binding_so_to_fp32_refuses(tmp_path):
    (fx,) = [f for f in AMBIGUOUS if f.meta["dtype"] != "fp32"]
    truth = fx.truth()
    # both candidates hold the same 16-bit values, the master rounds to them, yet it is not representable:
    # exporting it under either name gives different files
    assert torch.equal(truth["lowp/frozen.bias"], truth["lowp/ln.weight"])
    assert not torch.equal(truth["param/ln.weight"], truth["lowp/ln.weight"].float())
    out = tmp_path / "o.safetensors"
    res = CliRunner().invoke(main, ["to-fp32", str(fx.ckpt), str(out)])
    assert res.exit_code == 3
    assert "optimizer.fp32_groups[1][0] fits frozen.bias or ln.weight" in res.stderr
    assert not out.exists()
    # scan does not depend on names: it reads every stored tensor, the unbound master too
    res = CliRunner().invoke(main, ["scan", "--json", str(fx.ckpt)])
    assert res.exit_code == 0, res.output
    assert json.loads(res.stdout)["stored_tensors"] == json.loads(
        CliRunner().invoke(main, ["scan", "--json", str(fx.dir.parent / "s0_bf16_w1_adapter" / "ckpt")]).stdout
    )["stored_tensors"]


def test_diff_refuses_what_depends_on_an_open_binding(tmp_path):
    (fx,) = [f for f in AMBIGUOUS if f.meta["dtype"] == "fp32"]
    runner = CliRunner()
    out = tmp_path / "o.safetensors"
    assert runner.invoke(main, ["to-fp32", str(fx.ckpt), str(out)]).exit_code == 0
    assert runner.invoke(main, ["diff", str(fx.ckpt), str(out)]).exit_code == 0  # fp32 values agree
    res = runner.invoke(main, ["diff", "--role", "exp_avg", str(fx.ckpt), str(fx.ckpt)])
    assert res.exit_code == 3 and "diff --role exp_avg depends on which params own" in res.stderr
