"""What unpickling a checkpoint produces in place of the classes it names: inert stand-ins for DeepSpeed's own
classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address`` ...; :class:`DeepSpeedObject`), so deepspeed is never
imported, and torch's ``Size``, dtypes and devices as :class:`TorchSize`, :class:`TorchDtype` and
:class:`TorchDevice`, so parsing never imports torch (:func:`to_torch_value` turns them into the real objects).
Only :mod:`dsckpt.safe_load` creates them."""

from __future__ import annotations

import copyreg
import pickle
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from . import limits

if TYPE_CHECKING:
    pass

__all__ = ["ATTRIBUTE_DICTS", "STAND_INS", "SUBPARAM_SHAPE", "SUBPARAM_SHAPE_FIELDS", "AttributeDictStandIn", "DcpKey",
           "DeepSpeedDataclass", "DeepSpeedEnum", "DeepSpeedObject", "TorchDevice", "TorchDtype", "TorchSize",
           "stand_in_class", "subparam_shape", "to_torch_value", "torch_device", "torch_size"]

# --------------------------------------------------------------------------------------------
# Stand-ins for DeepSpeed's pickled classes


class DeepSpeedObject:
    """Inert stand-in for an instance of a pickled DeepSpeed (or other allow-listed) class.

    It keeps the pickled state as attributes and pickles back under the original class path
    (see :mod:`dsckpt.safe_save`), so DeepSpeed can load a file dsckpt rewrote.
    """

    ds_module: str = ""
    ds_name: str = ""

    def __setstate__(self, state: Any) -> None:
        # BUILD copies the state into the object: a shared state dict given to 10^6 objects is 10^6 copies.
        if isinstance(state, tuple):
            limits.charge_parsed(sum(104 * len(x) for x in state if isinstance(x, dict)))
        elif isinstance(state, dict):
            limits.charge_parsed(104 * len(state))
        if isinstance(state, tuple) and len(state) == 2:  # (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        if isinstance(state, dict):
            if any(not isinstance(k, str) or k.startswith("__") for k in state):
                # A dunder attribute (``__reduce_ex__`` ...) would change how the stand-in behaves.
                raise pickle.UnpicklingError(f"refusing state with special attributes for {self.ds_name}")
            self.__dict__.update(state)
        else:
            self.__dict__["_state"] = state

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (copyreg.__newobj__, (type(self),), dict(self.__dict__))  # type: ignore[attr-defined]

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.__dict__ == self.__dict__

    def __repr__(self) -> str:
        fields = ", ".join(f"{k}={v!r}" for k, v in self.__dict__.items())
        return f"<{self.ds_module}.{self.ds_name} {fields}>"


class DeepSpeedEnum(DeepSpeedObject):
    """Stand-in for a pickled ``enum.Enum`` member (pickled as ``Cls(value)``)."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __reduce_ex__(self, protocol: Any) -> Any:
        return (type(self), (self.value,))

    def __int__(self) -> int:
        return int(self.value)

    def __hash__(self) -> int:
        return hash((self.ds_module, self.ds_name, self.value))


class DeepSpeedDataclass(DeepSpeedObject):
    """Stand-in for a pickled DeepSpeed dataclass instance (pickled as ``cls.__new__(cls)`` + its ``__dict__``):
    its state must be a dict of exactly the dataclass's fields (``ds_fields``), nothing else."""

    ds_fields: tuple[str, ...] = ()

    def __setstate__(self, state: Any) -> None:
        if not isinstance(state, dict) or set(state) != set(self.ds_fields):
            got = sorted(map(str, state)) if isinstance(state, dict) else type(state).__name__
            raise pickle.UnpicklingError(f"refusing the state {got} for {self.ds_module}.{self.ds_name}, whose fields "
                                         f"are {list(self.ds_fields)}")
        super().__setstate__(state)


class DcpKey(DeepSpeedObject):
    """Stand-in for DCP's ``MetadataIndex`` (a frozen dataclass used as a dict key in ``.metadata``): hashable on
    its fields."""

    def __hash__(self) -> int:
        return hash(tuple(sorted((k, v if not isinstance(v, list) else tuple(v)) for k, v in self.__dict__.items())))


class _ReadOnlyClass(type):
    """Stand-in classes are shared by every load: a pickle's BUILD must not set attributes on them."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"stand-in class {cls.__name__} is read-only")


def _stand_in(module: str, name: str, base: type[DeepSpeedObject], **attrs: Any) -> type[DeepSpeedObject]:
    cls = _ReadOnlyClass(name, (base,), {"ds_module": module, "ds_name": name, "__module__": __name__, **attrs})
    return cls  # type: ignore[return-value]


_DCP_MD = "torch.distributed.checkpoint.metadata"
#: ``ds_to_universal`` (0.19.8) pickles one into a merged file of a param with sub-params of different sizes
#: (``zero/<name>/<state>.pt["sub_param_shape"]``, a Megatron-style ``parameter_with_sub_params`` record entry), and
#: DeepSpeed's universal loader cuts each sub-param by TP rank from it (universal_checkpoint.py).
SUBPARAM_SHAPE = ("deepspeed.checkpoint.universal_checkpoint", "SubparamShape")
SUBPARAM_SHAPE_FIELDS = ("patterns", "shape", "partition_dim")  # the dataclass's fields, in its order

STAND_INS: dict[tuple[str, str], type[DeepSpeedObject]] = {
    key: _stand_in(*key, base)
    for key, base in [
        (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), DeepSpeedObject),
        (("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"), DeepSpeedObject),
        (("deepspeed.runtime.zero.config", "ZeroStageEnum"), DeepSpeedEnum),
        (("deepspeed.utils.tensor_fragment", "fragment_address"), DeepSpeedObject),
        (("deepspeed.checkpoint.constants", "ZeroStageEnum"), DeepSpeedEnum),
        # Megatron-DeepSpeed stores its argparse namespace as client state.
        (("argparse", "Namespace"), DeepSpeedObject),
        # A PyTorch distributed checkpoint's .metadata (torch.distributed.checkpoint, torch 2.x): dataclasses
        # describing each item and where its bytes are (read by dsckpt.dcp_reader)
        *(((_DCP_MD, n), DeepSpeedObject) for n in ("Metadata", "TensorStorageMetadata", "BytesStorageMetadata",
                                                    "ChunkStorageMetadata", "TensorProperties", "StorageMeta")),
        ((_DCP_MD, "MetadataIndex"), DcpKey),
        ((_DCP_MD, "_MEM_FORMAT_ENCODING"), DeepSpeedEnum),
        (("torch.distributed.checkpoint.filesystem", "_StorageInfo"), DeepSpeedObject),
    ]
}
STAND_INS[SUBPARAM_SHAPE] = _stand_in(*SUBPARAM_SHAPE, DeepSpeedDataclass, ds_fields=SUBPARAM_SHAPE_FIELDS)


class AttributeDictStandIn(dict):  # type: ignore[type-arg]
    """Stand-in for Lightning's ``AttributeDict`` (a ``dict`` subclass with attribute access): the pickle's items
    become this dict's items; Lightning is never imported. Lightning 2.6 writes ``hyper_parameters`` as
    ``dict(model.hparams)``, but client state may hold one. DeepSpeed-layout writers pickle it back under
    Lightning's class path (``ds_module``/``ds_name``, like the DeepSpeed stand-ins); the Lightning export writes a
    plain ``dict``."""

    ds_module: str = ""
    ds_name: str = ""

    def __setstate__(self, state: Any) -> None:
        raise pickle.UnpicklingError(f"refusing to set attributes on {self.ds_module}.{self.ds_name}")


#: Lightning's ``AttributeDict`` under its 2.x paths (``lightning``, standalone ``lightning_fabric``) and 1.x path.
ATTRIBUTE_DICTS: dict[tuple[str, str], type[AttributeDictStandIn]] = {
    (module, name): _ReadOnlyClass(name, (AttributeDictStandIn,),  # type: ignore[misc]
                                   {"ds_module": module, "ds_name": name, "__module__": __name__})
    for module, name in [
        ("lightning.fabric.utilities.data", "AttributeDict"),
        ("lightning_fabric.utilities.data", "AttributeDict"),
        ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    ]
}


def subparam_shape(patterns: Any, shape: Any, partition_dim: Any) -> DeepSpeedObject:
    """A ``deepspeed.checkpoint.universal_checkpoint.SubparamShape`` as DeepSpeed pickles one (protocol 2: ``GLOBAL``,
    ``EMPTY_TUPLE``, ``NEWOBJ``, its fields as a dict in the dataclass's order, ``BUILD``), without deepspeed."""
    cls = STAND_INS[SUBPARAM_SHAPE]
    obj = cls.__new__(cls)
    obj.__setstate__(dict(zip(SUBPARAM_SHAPE_FIELDS, (patterns, shape, partition_dim))))
    return obj


def stand_in_class(module: str, name: str) -> type[DeepSpeedObject] | None:
    """The stand-in used for ``module.name``, if that class is on the allow-list."""
    return STAND_INS.get((module, name))


# --------------------------------------------------------------------------------------------
# Torch values in pickles, without torch


class TorchSize(tuple):  # type: ignore[type-arg]
    """A pickled ``torch.Size``: a tuple of ints."""

    def numel(self) -> int:
        n = 1
        for s in self:
            n *= int(s)
        return n

    def __repr__(self) -> str:
        return f"torch.Size({list(self)})"


@dataclass(frozen=True, slots=True)
class TorchDtype:
    """A pickled ``torch.<name>`` dtype (e.g. ``DynamicLossScaler.dtype``)."""

    name: str

    def __setstate__(self, state: Any) -> None:  # shared by every load: see _refuse_build
        raise pickle.UnpicklingError("refusing to set the state of an allow-listed torch dtype")

    def __repr__(self) -> str:
        return f"torch.{self.name}"


@dataclass(frozen=True)
class TorchDevice:
    """A pickled ``torch.device(*args)``."""

    args: tuple[Any, ...]

    def __repr__(self) -> str:
        return f"torch.device{self.args!r}"


def torch_size(dims: Any = ()) -> TorchSize:
    return TorchSize(int(d) for d in dims)


def torch_device(*args: Any) -> TorchDevice:
    return TorchDevice(tuple(args))


def to_torch_value(x: Any) -> Any:
    """The real torch object for a torch stand-in (imports torch); other values unchanged."""
    if isinstance(x, (TorchSize, TorchDtype, TorchDevice)):
        import torch

        if isinstance(x, TorchSize):
            return torch.Size(x)
        if isinstance(x, TorchDtype):
            return getattr(torch, x.name)
        return torch.device(*x.args)
    return x


