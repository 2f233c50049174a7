"""Lightning export: the one torch file ``to-fp32 CKPT OUT.ckpt`` writes, shaped as Lightning's converter writes it.

Lightning's ``DeepSpeedStrategy`` saves ``epoch=E-step=S.ckpt/`` as a DeepSpeed save dir (``latest`` = ``checkpoint``)
and passes its own checkpoint dict (``epoch``, ``global_step``, ``pytorch-lightning_version``, ``hyper_parameters``,
``loops``, ``callbacks``, ``lr_schedulers`` ...) to DeepSpeed as client state, which lands in the model-states files.
Lightning's ``convert_zero_checkpoint_to_fp32_state_dict`` (lightning 2.6.6, ``pytorch/utilities/deepspeed.py``)
writes ``torch.save({**rank0_model_states minus DeepSpeed's own keys, "state_dict": fp32 weights})``, which
``LightningModule.load_from_checkpoint`` reads. :func:`plan_client_state` picks the same keys from the same file;
lightning is never imported.

Lightning loads with ``torch.load`` and ``weights_only=None``, which means ``weights_only=True`` on torch >= 2.6: the
file may hold only tensors, ``torch.Size``/dtypes/devices, ``OrderedDict`` and builtins. Carried values are checked
against that set at plan time; Lightning's ``AttributeDict`` is written as the plain ``dict`` Lightning itself writes
(``dict(model.hparams)``); anything else is refused, naming its class and key (``--no-client-state`` leaves the
client state out).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import UnsafeCheckpointError, UnsupportedCheckpointError
from .model import LogicalCheckpoint
from .readers import FileCache
from .stand_ins import AttributeDictStandIn, DeepSpeedObject, TorchDevice, TorchDtype, TorchSize
from .tensor_ref import TensorRef

__all__ = [
    "CONVERTER_DROPPED_KEYS",
    "LIGHTNING_VERSION_KEY",
    "STATE_DICT_PREFIX",
    "ClientStatePlan",
    "client_state_tree",
    "lightning_name",
    "plan_client_state",
]

LIGHTNING_VERSION_KEY = "pytorch-lightning_version"

#: The model-states keys Lightning's converter drops (``deepspeed_states`` in lightning 2.6.6); it keeps every other
#: key, DeepSpeed's ``ds_config``, ``param_shapes``, ``buffer_names`` ... included.
CONVERTER_DROPPED_KEYS = ("module", "optimizer", "lr_scheduler", "csr_tensor_module_names", "skipped_steps",
                          "global_steps", "dp_world_size", "mp_world_size")

#: Lightning < 2.1 wrapped the module; the converter strips this prefix from state-dict names.
STATE_DICT_PREFIX = "_forward_module."

_PLAIN = (str, bytes, int, float, bool, type(None), TensorRef, TorchSize, TorchDtype, TorchDevice)


def lightning_name(name: str) -> str:
    """The state-dict name Lightning's converter writes for ``name``."""
    return name.removeprefix(STATE_DICT_PREFIX)


@dataclass(frozen=True)
class ClientStatePlan:
    """What an ``OUT.ckpt`` carries besides ``state_dict``: ``keys`` of ``source`` (rank 0's model-states file, the
    one Lightning's converter reads), in file order; ``dropped``: DeepSpeed's own keys left out, as the converter
    does."""

    source: Path
    keys: tuple[str, ...]
    dropped: tuple[str, ...]
    lightning_version: str | None

    def describe(self) -> list[str]:
        lines = [f"client state from {self.source.name}: " + (", ".join(self.keys) or "(none)")]
        if self.lightning_version is None:
            lines.append(f"  no '{LIGHTNING_VERSION_KEY}': not saved by Lightning's DeepSpeedStrategy")
        return lines


def _rank0_model_states(ckpt: LogicalCheckpoint) -> Path:
    # The converter's get_model_state_file: zero_pp_rank_0_mp_rank_00_model_states.pt at ZeRO-3, else mp_rank_00.
    name = "zero_pp_rank_0_mp_rank_00_model_states.pt" if ckpt.zero_stage == 3 else "mp_rank_00_model_states.pt"
    for f in ckpt.files:
        if f.name == name and f.parent == ckpt.tag_dir:
            return f
    raise UnsupportedCheckpointError(
        f"'{ckpt.tag_dir}': no {name}, where a Lightning export takes its client state from (layout {ckpt.layout}); "
        "write .safetensors or .pt instead, or pass --no-client-state")


def _refused(obj: Any, key: tuple[Any, ...], out: list[str], seen: set[int]) -> None:
    """What in ``obj`` Lightning's ``weights_only`` load refuses; a container shared by several places (the pickle
    memo) is looked at once, under the first path that reaches it."""
    if id(obj) in seen:
        return
    seen.add(id(obj))
    where = "".join(f"[{k!r}]" for k in key)
    if isinstance(obj, DeepSpeedObject):
        out.append(f"{obj.ds_module}.{obj.ds_name} at {where}")
    elif isinstance(obj, Mapping):
        if type(obj) not in (dict, OrderedDict) and not isinstance(obj, AttributeDictStandIn):
            out.append(f"{type(obj).__module__}.{type(obj).__qualname__} at {where}")
        for k, v in obj.items():
            if not isinstance(k, _PLAIN):
                out.append(f"{type(k).__module__}.{type(k).__qualname__} (a key) at {where}")
            _refused(v, (*key, k), out, seen)
    elif type(obj) in (list, tuple, set, frozenset):
        for i, v in enumerate(obj):
            _refused(v, (*key, i), out, seen)
    elif not isinstance(obj, _PLAIN):
        out.append(f"{type(obj).__module__}.{type(obj).__qualname__} at {where}")


def plan_client_state(ckpt: LogicalCheckpoint, cache: FileCache) -> ClientStatePlan:
    """Pick the client state an ``OUT.ckpt`` carries and check that ``torch.load`` with ``weights_only=True`` can read
    it.

    Reads pickle metadata only. Raises :class:`UnsafeCheckpointError` naming every value of another class."""
    source = _rank0_model_states(ckpt)
    tree = cache.tree(source)
    keys = tuple(k for k in tree if k not in CONVERTER_DROPPED_KEYS and k != "state_dict")
    dropped = tuple(k for k in tree if k in CONVERTER_DROPPED_KEYS)
    bad: list[str] = []
    seen: set[int] = set()
    for k in keys:
        if not isinstance(k, str):
            bad.append(f"{type(k).__module__}.{type(k).__qualname__} (a top-level key)")
        else:
            _refused(tree[k], (k,), bad, seen)
    if bad:
        raise UnsafeCheckpointError(
            f"{source}: the client state holds {'; '.join(bad[:5])}"
            + (f" (and {len(bad) - 5} more)" if len(bad) > 5 else "")
            + ": Lightning loads a .ckpt with torch.load and weights_only=True, which refuses such classes, and dsckpt "
            "writes only tensors, OrderedDict and builtins there. Pass --no-client-state to write state_dict alone, "
            "or export .safetensors / .pt")
    version = tree.get(LIGHTNING_VERSION_KEY)
    return ClientStatePlan(source, keys, dropped, version if isinstance(version, str) else None)


def _plain(obj: Any, memo: dict[int, Any]) -> Any:
    """``obj`` with every ``AttributeDict`` a plain dict; a container shared by several places (the pickle memo) is
    converted once and stays shared (looked up before anything is built)."""
    if id(obj) in memo:
        return memo[id(obj)]
    if isinstance(obj, AttributeDictStandIn):
        out: Any = {k: _plain(v, memo) for k, v in obj.items()}
    elif type(obj) in (dict, OrderedDict):
        out = type(obj)((k, _plain(v, memo)) for k, v in obj.items())
    elif type(obj) in (list, tuple, set, frozenset):
        out = type(obj)(_plain(v, memo) for v in obj)
    else:
        return obj
    memo[id(obj)] = out
    return out


def client_state_tree(plan: ClientStatePlan, cache: FileCache) -> dict[str, Any]:
    """The carried values, in file order, for :func:`dsckpt.writers.torch_stream.write_torch_tree` (tensor leaves are
    source :class:`TensorRef` s, copied byte for byte; ``AttributeDict`` s become plain dicts)."""
    tree = cache.tree(plan.source)
    memo: dict[int, Any] = {}
    return {k: _plain(tree[k], memo) for k in plan.keys}

