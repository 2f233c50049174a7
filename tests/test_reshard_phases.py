"""The three phases of a reshard plan (docs/design.md): the source described once, the target resolved in one table
of rules, the files planned from both. Behaviour is proven unchanged by bench/reshard_bytes.py; these tests pin what
each phase decides, on the committed fixtures (truth.json: what DeepSpeed's engine recorded)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dsckpt.ds_writers.plan import BF16_WRAPPER, ZERO3_WRAPPER, ZERO_WRAPPER
from dsckpt.ds_writers.source import describe_source
from dsckpt.ds_writers.target import RULES, ReshardRequest, resolve_target
from dsckpt.errors import UnsupportedCheckpointError, UsageError
from dsckpt.partition import DEFAULT_SUB_GROUP_SIZE
from dsckpt.readers import FileCache, read_checkpoint
from dsckpt.reshard import read_source_facts

FIXTURES = Path(__file__).parent / "fixtures"


def _source(name: str):
    cache = FileCache()
    ckpt = read_checkpoint(FIXTURES / name / "ckpt", cache=cache)
    return describe_source(ckpt, read_source_facts(ckpt, cache)), json.loads((FIXTURES / name / "truth.json")
                                                                              .read_text())


@pytest.mark.parametrize("name", ["s3_bf16_w3_subgroups", "s1_bf16_w2_bf16opt", "s2_bf16_w2_elastic", "pp2_bf16"])
def test_source_described_as_deepspeed_recorded(name):
    src, truth = _source(name)
    assert (src.stage, src.wrapper, src.precision.value) == (truth["stage"], truth["optimizer_wrapper"], truth["dtype"])
    assert src.elastic == name.endswith("elastic") and src.pipeline == name.startswith("pp2")
    assert src.bf16_prefixed_optim and not src.universal and not src.moe and not src.autoep
    assert len(src.optim_files) == truth["dp_world_size"] * truth.get("pp_size", 1)


def test_target_decisions_stage3_source():
    """A ZeRO-3 source keeps its sub_group_size at stage 3 (20 in its ds_config) unless given; another stage takes no
    sub-groups; the wrapper is DeepSpeed's for the target stage; a stage-0 target is rebuilt from the ZeRO files."""
    src, truth = _source("s3_bf16_w3_subgroups")
    t = resolve_target(src, ReshardRequest(2))
    assert (t.zero_stage, t.world_size, t.optimizer_wrapper) == (3, 2, ZERO3_WRAPPER)
    assert t.sub_group_size == truth["config"]["zero_optimization"]["sub_group_size"] == 20
    assert resolve_target(src, ReshardRequest(2, sub_group_size=40)).sub_group_size == 40
    z1 = resolve_target(src, ReshardRequest(4, zero_stage=1))
    assert (z1.optimizer_wrapper, z1.sub_group_size, z1.world_size, z1.parallel.dp) == (ZERO_WRAPPER, None, 4, 4)
    assert resolve_target(src, ReshardRequest(1, zero_stage=0)).stage0_rebuilt


def test_target_keeps_bf16_optimizer_at_stage_1_only():
    src, _ = _source("s1_bf16_w2_bf16opt")
    assert resolve_target(src, ReshardRequest(3)).optimizer_wrapper == BF16_WRAPPER
    assert resolve_target(src, ReshardRequest(3, zero_stage=2)).optimizer_wrapper == ZERO_WRAPPER
    assert resolve_target(src, ReshardRequest(3, zero_stage=3)).sub_group_size == DEFAULT_SUB_GROUP_SIZE
    with pytest.raises(UsageError, match="BF16_Optimizer files are written for bf16 checkpoints at ZeRO stage 1"):
        resolve_target(src, ReshardRequest(2, zero_stage=2, bf16_optimizer=True))


def test_rules_are_read_top_to_bottom():
    """The first row that refuses is reported: a pipeline source asked for ZeRO-2 with a bad --sub-group-size gets
    the usage error of the earlier row, then (with a good one) the pipeline row's refusal."""
    src, _ = _source("pp2_bf16")
    with pytest.raises(UsageError, match="--sub-group-size must be a positive integer, got 0"):
        resolve_target(src, ReshardRequest(2, zero_stage=2, sub_group_size=0))
    with pytest.raises(UnsupportedCheckpointError, match=r"\(a pipeline run\) to ZeRO stage 2: DeepSpeed's "
                                                         "PipelineEngine refuses ZeRO-2 and ZeRO-3"):
        resolve_target(src, ReshardRequest(2, zero_stage=2, sub_group_size=40))
    for bad in (None, 0, 2.0):
        with pytest.raises(UsageError, match=f"--world-size must be a positive integer, got {bad!r}"):
            resolve_target(src, ReshardRequest(bad))  # type: ignore[arg-type]
    flags = [r.flag for r in RULES]
    assert len(flags) == len(set(flags)) and flags.index("--world-size") == 0


def test_elastic_source_refused_other_targets_by_its_row():
    src, _ = _source("s2_bf16_w2_elastic")
    assert resolve_target(src, ReshardRequest(3, zero_stage=1)).zero_stage == 1
    with pytest.raises(UnsupportedCheckpointError, match=r"elastic_checkpoint save\) to ZeRO stage 3"):
        resolve_target(src, ReshardRequest(3, zero_stage=3))
