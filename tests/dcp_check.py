"""Load a ``dsckpt to-dcp`` folder the way a PyTorch job resumes, and compare it with a fixture's recorded truth.

Shared by tests/test_to_dcp.py (one plain process) and tests/dcp_fsdp_check.py (FSDP2 ``fully_shard`` on CPU ranks,
launched by torchrun). The model and optimizer are built as the fixture's generator built them
(tests/fixtures/fixture_models.py), in fp32 (the masters), with DeepSpeed's param groups: the trainable params
(DeepSpeed drops frozen ones), each group's options as the generator passed them, the ds_config's optimizer params as
AdamW's defaults. Those fresh groups are the hyper-parameter truth: the optimizer DeepSpeed built from the same
config and groups had these values, and nothing changed them (no scheduler in the fixtures).
"""

from __future__ import annotations

import copy
import json
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

FIXTURES = Path(__file__).parent / "fixtures"
if str(FIXTURES) not in sys.path:
    sys.path.insert(0, str(FIXTURES))

import fixture_models as fm


def build(name: str, shard: Callable[[torch.nn.Module], None] | None = None
          ) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """The fixture's model (fp32), wrapped by ``shard`` (FSDP2) before the optimizer is made, and a fresh AdamW
    over DeepSpeed's param groups."""
    spec = fm.FIXTURES[name]
    model = fm.build_model(spec).float()
    if shard is not None:
        shard(model)
    cfg = fm.ds_config(spec)["optimizer"]["params"]
    groups: list[dict[str, Any]] = []
    passed = fm.model_parameters(model, spec)
    passed = list(passed)
    if passed and isinstance(passed[0], dict):
        for g in passed:
            groups.append({**g, "params": [p for p in g["params"] if p.requires_grad]})
    else:
        groups.append({"params": [p for p in passed if p.requires_grad]})
    opts = {k: v for k, v in cfg.items() if k in ("lr", "weight_decay", "betas", "eps")}
    return model, torch.optim.AdamW(groups, **opts)


def group_truth(optimizer: torch.optim.Optimizer) -> list[dict[str, Any]]:
    """The hyper-parameters of each group of a freshly built optimizer (``params`` left out)."""
    return [copy.deepcopy({k: v for k, v in g.items() if k != "params"}) for g in optimizer.param_groups]


def load(model: torch.nn.Module, optimizer: torch.optim.Optimizer, out: str | Path) -> None:
    """What a resuming job does: the state dicts of the live objects, ``dcp.load`` into them, ``set_state_dict``."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import (
        get_model_state_dict,
        get_optimizer_state_dict,
        set_state_dict,
    )

    msd = get_model_state_dict(model)
    osd = get_optimizer_state_dict(model, optimizer)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(out), no_dist=not dist.is_initialized())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])


def _full(t: torch.Tensor) -> torch.Tensor:
    full = getattr(t, "full_tensor", None)
    return full() if full is not None else t


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.shape != b.shape:
        return False
    if a.is_floating_point() and b.is_floating_point():
        a, b = a.double(), b.double()
        return bool((a.eq(b) | (a.isnan() & b.isnan())).all())
    return bool(a.eq(b).all())


def compare(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            groups_before: list[dict[str, Any]]) -> list[str]:
    """Every difference between the loaded ``model``/``optimizer`` and fixture ``name``'s truth: each param and
    buffer under every state-dict name, each Adam state tensor and step, each group's params and hyper-parameters.
    Exact: the values travel as stored (fp32 masters and moments; 16-bit frozen params and buffers upcast)."""
    from safetensors.torch import load_file

    fx = FIXTURES / name
    meta = json.loads((fx / "truth.json").read_text())
    truth = load_file(str(fx / "truth.safetensors"))
    bad: list[str] = []
    sd = model.state_dict()  # every name, tied aliases included (FSDP2: DTensors, gathered one at a time)
    for key in meta["state_dict_names"]:
        want = truth.get(f"param/{key}", truth.get(f"buffer/{key}"))
        if key not in sd:
            bad.append(f"model: {key} missing")
            continue
        have = _full(sd[key])
        if want is None or not _same(have, want.to(have.dtype)) or not _same(have.to(want.dtype), want):
            bad.append(f"model: {key} differs")
    first_name: dict[int, str] = {}
    for n, p in model.named_parameters():
        first_name.setdefault(id(p), n)
    steps = {float(s) for s in meta["optimizer_step"]}
    for p, st in optimizer.state.items():
        n = first_name[id(p)]
        for key in ("exp_avg", "exp_avg_sq"):
            if not _same(_full(st[key]), truth[f"{key}/{n}"]):
                bad.append(f"optim: {n}.{key} differs")
        step = st["step"]
        if not (isinstance(step, torch.Tensor) and step.dtype == torch.float32 and step.dim() == 0
                and float(step) in steps):
            bad.append(f"optim: {n}.step is {step!r}, truth {sorted(steps)}")
    trained = {n for n in meta["trainable"] if n not in meta["tied"]}
    if {first_name[id(p)] for p in optimizer.state} != trained:
        bad.append(f"optim: state for {sorted(first_name[id(p)] for p in optimizer.state)}, expected {sorted(trained)}")
    if len(optimizer.param_groups) != len(groups_before):
        bad.append(f"optim: {len(optimizer.param_groups)} groups, expected {len(groups_before)}")
    for i, (g, want) in enumerate(zip(optimizer.param_groups, groups_before)):
        have = {k: v for k, v in g.items() if k != "params"}
        if have != want:
            diff = {k: (have.get(k), want.get(k)) for k in set(have) | set(want) if have.get(k) != want.get(k)}
            bad.append(f"optim: group {i} hyper-parameters differ: {diff}")
        names = [first_name[id(p)] for p in g["params"]]
        truth_names = [n for n in meta["param_groups"][i] if n not in meta["tied"]] if i < len(meta["param_groups"]) \
            else None
        if truth_names is not None and sorted(names) != sorted(truth_names):
            bad.append(f"optim: group {i} holds {names}, truth {truth_names}")
    return bad


def one_more_step(name: str, model: torch.nn.Module, optimizer: torch.optim.Optimizer, rank: int = 0) -> float:
    """One training step on the fixture's next batch (step 3, as the 4th); returns the loss. Proves the loaded
    state is usable: the step runs and every trained param and moment changes."""
    ids, tgt = fm.make_batch(3, rank)
    loss = torch.nn.functional.cross_entropy(model(ids), tgt)
    loss.backward()
    optimizer.step()
    optimizer.zero_grad()
    return loss.item()


# --------------------------------------------------------------------------------------------
# families whose module cannot be built in one plain process (PipelineModule, DeepSpeed MoE, AutoEP's engine, a
# Megatron-style TP x pipeline net): a module of the recorded state-dict names and shapes, built for the comparison


class RecordedTruth:
    """What a fixture recorded, under the FQNs to-dcp writes: ``model`` (every state-dict name -> value), ``params``
    (the param names, the rest are buffers) and ``trainable``, ``state`` (trained param -> exp_avg, exp_avg_sq),
    ``step``, ``groups`` (per param group: its params and the keys DeepSpeed's recipe adds) and the ds_config's
    optimizer params."""

    def __init__(self, model: dict[str, torch.Tensor], params: list[str], trainable: list[str],
                 state: dict[str, dict[str, torch.Tensor]], step: float, groups: list[tuple[list[str], dict[str, Any]]],
                 opt: dict[str, Any]) -> None:
        self.model, self.params, self.trainable, self.state = model, params, trainable, state
        self.step, self.groups, self.opt = step, groups, opt


def recorded_truth(name: str) -> RecordedTruth:
    """The truth of fixture ``name`` (a path under tests/fixtures): ``pp2_*`` and ``moe_*`` (generate.py /
    generate_moe.py: ``param|buffer|exp_avg|exp_avg_sq/<name>``), ``autoep/*`` (generate_autoep.py: the HF model's
    ``hf_fp32/<name>``, the moments under AutoEP's names, mapped as the HF model holds them: ``gate_up_proj`` is
    ``cat([w1, w3], dim=1)``, ``down_proj`` is ``w2``, ``gate`` is ``router.gate``) and ``tp_pipeline/*``
    (generate_tp_pipeline.py: DeepSpeed's own merge of the TP slices, ``ds_to_universal``'s ``fp32|exp_avg|
    exp_avg_sq/<name>``)."""
    from safetensors.torch import load_file

    fx = FIXTURES / name
    meta = json.loads((fx / "truth.json").read_text())
    opt = meta["config"]["optimizer"]["params"]
    if name.startswith("tp_pipeline/"):
        u = load_file(str(fx / "universal_truth.safetensors"))
        params = list(meta["params"])
        model = {n: u[f"fp32/{n}"] for n in params}
        state = {n: {k: u[f"{k}/{n}"] for k in ("exp_avg", "exp_avg_sq")} for n in params}
        return RecordedTruth(model, params, params, state, float(meta["steps"]), [(params, {})], opt)
    truth = load_file(str(fx / "truth.safetensors"))
    if name.startswith("autoep/"):
        hf = list(meta["hf_names"])
        model = {n: truth[f"hf_fp32/{n}"] for n in hf}
        experts = [n for n in hf if ".mlp.experts." in n]

        def moment(key: str, n: str) -> torch.Tensor:
            mlp = n.rsplit(".", 2)[0]
            if n.endswith(".experts.gate_up_proj"):
                return torch.cat([truth[f"{key}/{mlp}.experts.w1"], truth[f"{key}/{mlp}.experts.w3"]], dim=1)
            if n.endswith(".experts.down_proj"):
                return truth[f"{key}/{mlp}.experts.w2"]
            if n.endswith(".mlp.gate.weight"):
                return truth[f"{key}/{n.removesuffix('.gate.weight')}.router.gate.weight"]
            return truth[f"{key}/{n}"]

        state = {n: {k: moment(k, n) for k in ("exp_avg", "exp_avg_sq")} for n in hf}
        # AutoEP's split of model.parameters() (deepspeed/moe/utils.py): the dense group, then the expert group
        groups = [([n for n in hf if n not in experts], {"name": "dense-params"}),
                  (experts, {"name": f"ep_size_{meta['ep_size']}", "moe": True})]
        return RecordedTruth(model, hf, hf, state, float(meta["adam_step"][0]), groups, opt)
    names = list(meta["state_dict_names"])
    model = {n: truth.get(f"param/{n}", truth.get(f"buffer/{n}")) for n in names}
    trained = [n for n in meta["trainable"] if n not in meta["tied"]]
    state = {n: {k: truth[f"{k}/{n}"] for k in ("exp_avg", "exp_avg_sq")} for n in trained}
    groups = [([n for n in g if n not in meta["tied"]], {}) for g in meta["param_groups"]]
    if "moe" in meta:  # moe_models.moe_param_groups: DeepSpeed's split of the group {"name": "dense"}
        groups = [(groups[0][0], {"name": "dense"}),
                  (groups[1][0], {"name": meta["moe"]["expert_group_name"], "moe": True})]
    return RecordedTruth(model, list(meta["params"]), list(meta["trainable"]), state,
                         float(meta["optimizer_step"][0]), groups, opt)


def build_from_truth(t: RecordedTruth) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """A module holding a param (or buffer) of every recorded name and shape, zeros, and an AdamW over the recorded
    groups with the ds_config's optimizer params and the group keys of DeepSpeed's recipe."""
    root = torch.nn.Module()
    made: dict[str, torch.nn.Parameter] = {}
    for n, v in t.model.items():
        *path, leaf = n.split(".")
        mod = root
        for part in path:
            if not hasattr(mod, part):
                mod.add_module(part, torch.nn.Module())
            mod = getattr(mod, part)
        if n in t.params:
            made[n] = torch.nn.Parameter(torch.zeros(v.shape, dtype=torch.float32), requires_grad=n in t.trainable)
            mod.register_parameter(leaf, made[n])
        else:
            mod.register_buffer(leaf, torch.zeros(v.shape, dtype=v.dtype))
    opts = {k: v for k, v in t.opt.items() if k in ("lr", "weight_decay", "betas", "eps")}
    return root, torch.optim.AdamW([{"params": [made[n] for n in names], **extra} for names, extra in t.groups],
                                   **opts)


def compare_with_truth(t: RecordedTruth, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                       groups_before: list[dict[str, Any]]) -> list[str]:
    """Every difference between the loaded ``model``/``optimizer`` and the recorded truth, exactly."""
    bad: list[str] = []
    sd = model.state_dict()
    for n, want in t.model.items():
        if not _same(sd[n], want.to(sd[n].dtype)) or not _same(sd[n].to(want.dtype), want):
            bad.append(f"model: {n} differs")
    name_of = {id(p): n for n, p in model.named_parameters()}
    for p, st in optimizer.state.items():
        n = name_of[id(p)]
        bad += [f"optim: {n}.{k} differs" for k, want in t.state[n].items() if not _same(st[k], want)]
        if not (st["step"].dtype == torch.float32 and st["step"].dim() == 0 and float(st["step"]) == t.step):
            bad.append(f"optim: {n}.step is {st['step']!r}, truth {t.step}")
    if sorted(name_of[id(p)] for p in optimizer.state) != sorted(t.state):
        bad.append(f"optim: state for {sorted(name_of[id(p)] for p in optimizer.state)}, expected {sorted(t.state)}")
    for i, (g, want, (names, _)) in enumerate(zip(optimizer.param_groups, groups_before, t.groups)):
        if {k: v for k, v in g.items() if k != "params"} != want:
            bad.append(f"optim: group {i} hyper-parameters differ")
        if [name_of[id(p)] for p in g["params"]] != names:
            bad.append(f"optim: group {i} holds {[name_of[id(p)] for p in g['params']]}, truth {names}")
    return bad
