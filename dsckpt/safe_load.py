"""The only place in dsckpt that unpickles.

``load(path)`` parses a ``torch.save`` file (zip format, or the legacy non-zip format that DeepSpeed
writes with ``"checkpoint_serialization": false``) with a restricted unpickler:

* globals are resolved from an allow-list; anything else raises :class:`UnsafeCheckpointError`
  naming the class and the file, before any of it runs;
* DeepSpeed's own classes (``LossScaler``, ``ZeroStageEnum``, ``fragment_address`` ...) become inert
  stand-ins (:class:`DeepSpeedObject`), so deepspeed is never imported;
* tensors are not read: each becomes a :class:`TensorRef` that knows where its bytes are in the file.
  ``TensorRef.read()`` reads exactly the elements asked for with ``pread``; storages saved on a GPU
  are read to CPU like any other;
* every byte read of a zip record is checked against the record's CRC-32 while it is read
  (:mod:`dsckpt.crc`; ``StorageRef.check``); :func:`finish_checks` completes the checks of records
  read only partly. Legacy non-zip files carry no CRCs (``StorageRef.crc32 is None``);
* parsing does not import torch: dtypes are names (:mod:`dsckpt.dtypes`), and ``torch.Size``,
  torch dtypes and devices in the pickle become :class:`TorchSize`, :class:`TorchDtype` and
  :class:`TorchDevice`. :func:`materialize` turns them into the real torch objects, and
  :mod:`dsckpt.safe_save` writes them back as torch's own.

Nothing else in dsckpt calls ``torch.load`` or ``pickle.load``.
"""

from __future__ import annotations

import copyreg
import io
import math
import os
import pickle
import struct
import types
import zipfile
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from . import crc, limits
from .dtypes import DTYPES, dtype_info
from .errors import CorruptCheckpointError, UnsafeCheckpointError, shorten

if TYPE_CHECKING:
    import torch

__all__ = [
    "AttributeDictStandIn",
    "DeepSpeedEnum",
    "DeepSpeedObject",
    "StorageRef",
    "TensorRef",
    "TorchDevice",
    "TorchDtype",
    "TorchSize",
    "check_tree",
    "finish_checks",
    "load",
    "load_with_info",
    "materialize",
    "walk_tensors",
]

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


class _ReadOnlyClass(type):
    """Stand-in classes are shared by every load: a pickle's BUILD must not set attributes on them."""

    def __setattr__(cls, name: str, value: Any) -> None:
        raise AttributeError(f"stand-in class {cls.__name__} is read-only")


def _stand_in(module: str, name: str, base: type[DeepSpeedObject]) -> type[DeepSpeedObject]:
    cls = _ReadOnlyClass(name, (base,), {"ds_module": module, "ds_name": name, "__module__": __name__})
    return cls  # type: ignore[return-value]


_STAND_INS: dict[tuple[str, str], type[DeepSpeedObject]] = {
    key: _stand_in(*key, base)
    for key, base in [
        (("deepspeed.runtime.fp16.loss_scaler", "LossScaler"), DeepSpeedObject),
        (("deepspeed.runtime.fp16.loss_scaler", "DynamicLossScaler"), DeepSpeedObject),
        (("deepspeed.runtime.zero.config", "ZeroStageEnum"), DeepSpeedEnum),
        (("deepspeed.utils.tensor_fragment", "fragment_address"), DeepSpeedObject),
        (("deepspeed.checkpoint.constants", "ZeroStageEnum"), DeepSpeedEnum),
        # Megatron-DeepSpeed stores its argparse namespace as client state.
        (("argparse", "Namespace"), DeepSpeedObject),
    ]
}


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
_ATTRIBUTE_DICTS: dict[tuple[str, str], type[AttributeDictStandIn]] = {
    (module, name): _ReadOnlyClass(name, (AttributeDictStandIn,),  # type: ignore[misc]
                                   {"ds_module": module, "ds_name": name, "__module__": __name__})
    for module, name in [
        ("lightning.fabric.utilities.data", "AttributeDict"),
        ("lightning_fabric.utilities.data", "AttributeDict"),
        ("pytorch_lightning.utilities.parsing", "AttributeDict"),
    ]
}


def stand_in_class(module: str, name: str) -> type[DeepSpeedObject] | None:
    """The stand-in used for ``module.name``, if that class is on the allow-list."""
    return _STAND_INS.get((module, name))


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


def _torch_size(dims: Any = ()) -> TorchSize:
    return TorchSize(int(d) for d in dims)


def _torch_device(*args: Any) -> TorchDevice:
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


# --------------------------------------------------------------------------------------------
# Lazy tensors


@dataclass(frozen=True)
class StorageRef:
    """Where one pickled storage's bytes are: ``nbytes`` bytes at ``file_offset`` in ``path``.

    In a zip-format file the storage is the start of a record (``record``, ``record_nbytes`` bytes,
    stored CRC-32 ``crc32``) and ``check`` is the record's shared read-time check (None when
    ``DSCKPT_NO_CRC`` is set). Legacy (non-zip) files store no CRC: ``crc32`` is None.
    """

    path: Path
    key: str
    dtype_name: str
    numel: int
    file_offset: int
    location: str
    record: str | None = None
    record_nbytes: int | None = None
    crc32: int | None = None
    check: crc.RecordCheck | None = field(default=None, compare=False, repr=False)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; use :attr:`dtype_name` on torch-free paths)."""
        import torch

        return getattr(torch, self.dtype_name)

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype_name].itemsize

    @property
    def nbytes(self) -> int:
        return self.numel * self.itemsize


@dataclass(frozen=True, eq=False)
class TensorRef:
    """A tensor in a checkpoint file, not yet read. ``read`` returns CPU tensors."""

    storage: StorageRef
    storage_offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    requires_grad: bool = False
    attrs: Mapping[str, Any] = field(default_factory=dict)

    @property
    def dtype(self) -> torch.dtype:
        """The torch dtype (imports torch; use :attr:`dtype_name` on torch-free paths)."""
        return self.storage.dtype

    @property
    def dtype_name(self) -> str:
        return self.storage.dtype_name

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.storage.itemsize

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in zip(reversed(self.shape), reversed(self.stride)):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True

    def _check_range(self, start: int, numel: int | None) -> int:
        total = self.numel
        if numel is None:
            numel = total - start
        if start < 0 or numel < 0 or start + numel > total:
            raise CorruptCheckpointError(
                f"{self.storage.path}: asked for elements [{start}, {start + numel}) of a tensor "
                f"with {total} elements; the checkpoint metadata does not match its tensors"
            )
        # Checked before any buffer is allocated: a corrupt shape may claim 1e12 elements.
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride)) if total else 0
        if self.storage_offset < 0 or any(st < 0 for st in self.stride) or \
                self.storage_offset + span > self.storage.numel:
            raise CorruptCheckpointError(
                f"{self.storage.path}: a tensor of shape {list(self.shape)} at offset {self.storage_offset} "
                f"runs past the end of its storage {self.storage.key!r} ({self.storage.numel} elements); "
                "the file is corrupt")
        return numel

    def read(self, start: int = 0, numel: int | None = None, *, out: torch.Tensor | None = None) -> torch.Tensor:
        """Read ``numel`` elements starting at flat element ``start`` (row-major order) as a torch
        tensor.

        With ``out`` (a contiguous 1-D tensor of this dtype and ``numel`` elements) the bytes are read
        straight into it.
        """
        import torch

        numel = self._check_range(start, numel)
        if not self.is_contiguous():
            full = self._read_strided()
            flat = full.reshape(-1)[start : start + numel]
            if out is None:
                return flat.clone()
            out.copy_(flat)
            return out
        if out is None:
            out = torch.empty(numel, dtype=self.dtype)
        _read_bytes(self.storage, self.storage_offset + start, numel, _byte_view(out.view(torch.uint8).numpy()))
        return out

    def read_numpy(self, start: int = 0, numel: int | None = None, *, out: np.ndarray | None = None,
                   fd: int | None = None) -> np.ndarray:
        """Like :meth:`read`, without torch: a 1-D numpy array of the stored bytes' numpy dtype
        (``uint16`` for bfloat16; see :mod:`dsckpt.dtypes`). Contiguous tensors only.

        ``fd``: a descriptor of this file, open for reading, to read with (``pread`` keeps no file
        position, so threads may share one); by default the file is opened for this read only."""
        numel = self._check_range(start, numel)
        if not self.is_contiguous():
            raise ValueError(f"{self!r} is strided; read it with read()")
        if out is None:
            out = np.empty(numel, dtype=DTYPES[self.dtype_name].numpy)
        _read_bytes(self.storage, self.storage_offset + start, numel, _byte_view(out), fd=fd)
        return out

    def item(self) -> int | float:
        """The value of a one-element tensor (Adam's ``step``, a loss scale), read without torch and
        CRC-checked like every read: an int for integer and bool dtypes (exact, as torch's ``item()``),
        else a float (a complex value gives its real part)."""
        if self.numel != 1:
            raise ValueError(f"{self!r} has {self.numel} elements; item() reads one-element tensors")
        raw = self.read_numpy(0, 1)
        if self.dtype_name in ("bfloat16", "float16"):
            from .dtypes import to_float32

            raw = to_float32(raw, self.dtype_name)
        value = raw[0]
        if value.dtype.kind in "biu":
            return int(value)
        return float(value.real) if np.iscomplexobj(value) else float(value)

    def load(self) -> torch.Tensor:
        """The whole tensor, shaped, as a CPU tensor that owns its memory."""
        if self.is_contiguous():
            return self.read().view(self.shape)
        return self._read_strided().contiguous()

    def _read_strided(self) -> torch.Tensor:
        import torch

        self._check_range(0, None)

        if self.numel == 0:
            return torch.empty(self.shape, dtype=self.dtype)
        span = 1 + sum((s - 1) * st for s, st in zip(self.shape, self.stride))
        flat = torch.empty(span, dtype=self.dtype)
        _read_bytes(self.storage, self.storage_offset, span, _byte_view(flat.view(torch.uint8).numpy()))
        return flat.as_strided(self.shape, self.stride)

    def __repr__(self) -> str:
        return f"TensorRef({self.dtype}, {list(self.shape)}, {self.storage.path.name}:{self.storage.key})"


def _byte_view(array: np.ndarray) -> memoryview:
    return array.reshape(-1).view(np.uint8).data.cast("B")


def _read_bytes(storage: StorageRef, first: int, numel: int, view: memoryview, *, fd: int | None = None) -> None:
    """``pread`` elements ``[first, first + numel)`` of ``storage`` into ``view`` (raw bytes), through
    ``fd`` if given (else the file is opened for this read)."""
    itemsize = storage.itemsize
    if first + numel > storage.numel:
        raise CorruptCheckpointError(
            f"{storage.path}: tensor runs past the end of its storage {storage.key!r} "
            f"({first + numel} > {storage.numel} elements); the file is corrupt"
        )
    if numel == 0:
        return
    nbytes = numel * itemsize
    offset = storage.file_offset + first * itemsize
    own = fd is None
    if fd is None:
        fd = os.open(storage.path, os.O_RDONLY)
    try:
        got = 0
        while got < nbytes:
            n = os.preadv(fd, [view[got:nbytes]], offset + got)
            if n == 0:
                raise CorruptCheckpointError(
                    f"{storage.path}: file ends inside tensor data (storage {storage.key!r}); "
                    "the file is truncated — the save was probably interrupted"
                )
            got += n
    finally:
        if own:
            os.close(fd)
    if storage.check is not None:
        storage.check.update(first * itemsize, view[:nbytes])


# --------------------------------------------------------------------------------------------
# Allow-listed globals

_STORAGE_DTYPES: dict[str, str] = {d.storage: d.name for d in DTYPES.values()} | {"UntypedStorage": "uint8"}


# Allow-listed objects are shared by every load, so none of them may be changed by a pickle's BUILD
# opcode (which writes into ``__dict__`` or calls ``setattr``): a BUILD on the shared FloatStorage
# marker once turned every later float32 storage into int8. Hence slots and frozen classes, and
# plain functions wrapped in :class:`_ReadOnlyCallable`.


def _refuse_build(self: Any, state: Any) -> None:
    raise pickle.UnpicklingError(f"refusing to set the state of the allow-listed {type(self).__name__}")


@dataclass(frozen=True, slots=True)
class _StorageType:
    dtype: str

    __setstate__ = _refuse_build


@dataclass(frozen=True, slots=True)
class _TensorType:
    """Marker for ``torch.Tensor`` / ``torch.nn.Parameter`` used as ``new_type`` in rebuild calls."""

    name: str

    __setstate__ = _refuse_build


class _ReadOnlyCallable:
    __slots__ = ("_fn",)
    _fn: Callable[..., Any]

    def __init__(self, fn: Callable[..., Any]) -> None:
        object.__setattr__(self, "_fn", fn)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self._fn(*args, **kwargs)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("allow-listed callables are read-only")

    __setstate__ = _refuse_build


def _rebuild_tensor_v2(
    storage: Any, storage_offset: int, size: Any, stride: Any, requires_grad: bool = False,
    backward_hooks: Any = None, metadata: Any = None,
) -> TensorRef:
    if not isinstance(storage, (StorageRef, _LegacyStorage)):
        raise pickle.UnpicklingError("tensor rebuilt from something that is not a storage")
    shape, strides, offset = tuple(int(s) for s in size), tuple(int(s) for s in stride), int(storage_offset)
    # torch refuses these too (sizes and strides are int64, a size is never negative).
    if len(shape) != len(strides) or any(not 0 <= s < 1 << 63 for s in (*shape, offset)) or \
            any(not -(1 << 63) <= s < 1 << 63 for s in strides):
        raise pickle.UnpicklingError(f"a tensor with shape {shorten(list(shape))}, stride {shorten(list(strides))} "
                                     f"and offset {shorten(offset)}, which torch cannot hold")
    # A legacy-format placeholder is swapped for its located StorageRef by _replace_legacy.
    return TensorRef(storage, offset, shape, strides, bool(requires_grad))  # type: ignore[arg-type]


def _rebuild_tensor(storage: Any, storage_offset: int, size: Any, stride: Any) -> TensorRef:
    return _rebuild_tensor_v2(storage, storage_offset, size, stride)


def _rebuild_parameter(data: Any, requires_grad: bool, backward_hooks: Any, *state: Any) -> Any:
    if isinstance(data, TensorRef):
        return TensorRef(data.storage, data.storage_offset, data.shape, data.stride, bool(requires_grad),
                         data.attrs)
    return data


def _rebuild_from_type_v2(func: Callable[..., Any], new_type: Any, args: tuple, state: Any) -> Any:
    ret = func(*args)
    if isinstance(ret, TensorRef) and isinstance(state, dict) and state:
        # Stage-3 fp32 flat groups carry a ``ds_id`` attribute (DeepSpeed 0.19.8, stage3.py).
        ret = TensorRef(ret.storage, ret.storage_offset, ret.shape, ret.stride, ret.requires_grad,
                        {**ret.attrs, **state})
    return ret


def _safe_reconstructor(cls: Any, base: Any, state: Any) -> Any:
    if not (isinstance(cls, type) and issubclass(cls, DeepSpeedObject)) or base is not object:
        raise pickle.UnpicklingError(f"copyreg._reconstructor called with {cls!r}")
    obj = cls.__new__(cls)
    return obj


def _codecs_encode(obj: Any, encoding: str = "utf-8", errors: str = "strict") -> bytes:
    # numpy pickles bytes (the Mersenne Twister key of np.random.get_state(), saved in HF Trainer
    # rng_state_*.pth) as _codecs.encode(str, "latin1") for protocol-2 compatibility.
    if not isinstance(obj, str) or encoding not in ("latin1", "latin-1") or errors != "strict":
        raise pickle.UnpicklingError(f"_codecs.encode called with {type(obj).__name__}, {encoding!r}")
    return obj.encode("latin1")


def _bytearray(source: Any = b"", *args: Any) -> bytearray:
    # Protocols < 5 pickle a bytearray as bytearray(<str>, "latin-1"); bytearray(<int>) would allocate (and zero)
    # as many bytes as the pickle asks for.
    if not isinstance(source, (bytes, str)):
        raise pickle.UnpicklingError(f"bytearray built from {type(source).__name__}, not from bytes")
    return bytearray(source, *args)


def _numpy_globals() -> dict[tuple[str, str], Any]:
    import numpy as np

    out: dict[tuple[str, str], Any] = {}
    try:
        from numpy._core.multiarray import _reconstruct, scalar  # type: ignore[attr-defined]
    except ImportError:  # numpy < 2
        from numpy.core.multiarray import _reconstruct, scalar  # type: ignore[no-redef]
    for mod in ("numpy.core.multiarray", "numpy._core.multiarray"):
        out[(mod, "_reconstruct")] = _safe_np_reconstruct(_reconstruct)
        out[(mod, "scalar")] = scalar
    out[("numpy", "ndarray")] = np.ndarray
    out[("numpy", "dtype")] = np.dtype
    return out


def _safe_np_reconstruct(real: Callable[..., Any]) -> Callable[..., Any]:
    import numpy as np

    def reconstruct(subtype: Any, shape: Any, dtype: Any) -> Any:
        if subtype is not np.ndarray:
            raise pickle.UnpicklingError(f"numpy reconstruct of {subtype!r} refused")
        return real(subtype, shape, dtype)

    return reconstruct


def _build_allowed() -> dict[tuple[str, str], Any]:
    allowed: dict[tuple[str, str], Any] = {
        ("collections", "OrderedDict"): OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): _rebuild_tensor_v2,
        ("torch._utils", "_rebuild_tensor"): _rebuild_tensor,
        ("torch._utils", "_rebuild_parameter"): _rebuild_parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): _rebuild_parameter,
        ("torch._tensor", "_rebuild_from_type_v2"): _rebuild_from_type_v2,
        ("torch", "Tensor"): _TensorType("Tensor"),
        ("torch.nn.parameter", "Parameter"): _TensorType("Parameter"),
        ("torch", "Size"): _torch_size,
        ("torch", "device"): _torch_device,
        ("copyreg", "_reconstructor"): _safe_reconstructor,
        ("builtins", "object"): object,
        ("builtins", "set"): set,
        ("builtins", "frozenset"): frozenset,
        ("builtins", "slice"): slice,
        ("builtins", "complex"): complex,
        ("builtins", "bytearray"): _bytearray,
        ("__builtin__", "set"): set,
        ("_codecs", "encode"): _codecs_encode,
    }
    for name, dtype in _STORAGE_DTYPES.items():
        allowed[("torch", name)] = _StorageType(dtype)
    allowed[("torch.storage", "UntypedStorage")] = _StorageType("uint8")
    for name in [*DTYPES, "float", "double", "half", "long", "int", "short", "cfloat", "cdouble"]:
        allowed[("torch", name)] = TorchDtype(dtype_info(name).name)
    allowed.update(_STAND_INS)
    allowed.update(_ATTRIBUTE_DICTS)
    try:
        allowed.update(_numpy_globals())
    except ImportError:  # numpy is a dependency, but reading must not break without it
        pass
    return {k: _ReadOnlyCallable(v) if isinstance(v, types.FunctionType) else v for k, v in allowed.items()}


_ALLOWED = _build_allowed()


# --------------------------------------------------------------------------------------------
# The unpickler


class _AllowListed:
    """find_class / persistent_load of dsckpt's unpicklers (the C one below, and the pure-Python one
    for legacy files)."""

    _path: Path
    _resolve_storage: Callable[[tuple], StorageRef]

    def __init__(self, file: Any, *, path: Path, resolve_storage: Callable[[tuple], StorageRef]) -> None:
        super().__init__(file, encoding="utf-8")  # type: ignore[call-arg]
        self._path = path
        self._resolve_storage = resolve_storage

    def find_class(self, module: str, name: str) -> Any:
        try:
            return _ALLOWED[(module, name)]
        except KeyError:
            raise UnsafeCheckpointError(
                f"{self._path}: refusing to unpickle global '{module}.{name}': it is not on dsckpt's "
                "allow-list of classes found in DeepSpeed checkpoints, and loading it could run code. "
                "Nothing was executed. If you trust this file, report the class so it can be added."
            ) from None

    def persistent_load(self, pid: Any) -> Any:
        if not isinstance(pid, tuple) or not pid:
            raise pickle.UnpicklingError(f"unexpected persistent id {pid!r}")
        typename = pid[0].decode("ascii") if isinstance(pid[0], bytes) else pid[0]
        if typename != "storage":
            raise pickle.UnpicklingError(f"unexpected persistent id type {typename!r}")
        return self._resolve_storage(pid[1:])


class _Unpickler(_AllowListed, pickle.Unpickler):
    pass


class _LegacyUnpickler(_AllowListed, pickle._Unpickler):  # type: ignore[name-defined,misc]
    """Pure Python: every opcode's bytes come through ``read(n)``, so :class:`_BoundedReader` refuses a
    damaged length before anything is allocated (the C unpickler allocates BINBYTES/BYTEARRAY8 first).
    Legacy files carry no CRC, so their pickles are the ones damage reaches."""

    def _load_bytearray8(self) -> None:  # pickle's own allocates bytearray(len) before reading
        (n,) = struct.unpack("<Q", self.read(8))  # type: ignore[attr-defined]
        self.append(bytearray(self.read(n)))  # type: ignore[attr-defined]

    dispatch = {**pickle._Unpickler.dispatch, pickle.BYTEARRAY8[0]: _load_bytearray8}  # type: ignore[attr-defined,dict-item]


def load(path: str | os.PathLike[str]) -> Any:
    """Parse a ``torch.save`` file safely; tensors come back as :class:`TensorRef`.

    Raises :class:`UnsafeCheckpointError` for a global outside the allow-list and
    :class:`CorruptCheckpointError` for a truncated or malformed file.
    """
    return load_with_info(path)[0]


@dataclass(frozen=True)
class FileInfo:
    """What the container of a parsed file says about the file itself.

    ``archive_name``: the folder its zip records sit in — ``torch.save`` names it after the file it
    saves to (``zero_pp_rank_1_mp_rank_00_optim_states/data.pkl``), so a renamed copy still carries the
    old name (None: legacy format). ``records``: ``(record name without that folder, CRC-32, size)`` of
    every zip record, sorted; two files with equal records hold the same bytes."""

    archive_name: str | None
    records: tuple[tuple[str, int, int], ...] = ()


def load_with_info(path: str | os.PathLike[str]) -> tuple[Any, FileInfo]:
    """:func:`load`, and what the file's container says about it (:class:`FileInfo`)."""
    p = Path(path)
    try:
        with os.fdopen(limits.open_regular(p), "rb") as f:
            head = f.read(4)
            if head[:2] == b"PK":
                obj, info = _load_zip(p, f)
            else:
                obj, info = _load_legacy(p, f), FileInfo(None)
        check_tree(obj, p)
        return obj, info
    except (UnsafeCheckpointError, CorruptCheckpointError):
        raise
    except RecursionError as e:  # a guard below missed a nesting: still a damaged file, never exit 70
        raise limits.exceeded(p, "nesting deeper than Python can follow", None, "max_depth") from e
    except (pickle.UnpicklingError, EOFError, zipfile.BadZipFile, struct.error, ValueError,
            TypeError, KeyError, AttributeError, IndexError, UnicodeDecodeError,
            NotImplementedError, OverflowError) as e:  # zipfile: "zip file version 13.4"
        raise CorruptCheckpointError(
            f"{p}: cannot be parsed as a torch checkpoint file ({type(e).__name__}: {shorten(str(e), 200)}); "
            "it is truncated or corrupt — the save was probably interrupted"
        ) from e
    except OSError as e:  # a zip directory pointing before the start of the file: seek() fails with EINVAL
        raise CorruptCheckpointError(
            f"{p}: cannot be read as a torch checkpoint file ({e.strerror or e}); its zip directory points "
            "outside the file — it is truncated or corrupt") from e


def _load_zip(path: Path, raw: Any) -> tuple[Any, FileInfo]:
    with zipfile.ZipFile(raw) as zf:
        names = zf.namelist()
        if len(set(names)) != len(names):
            dup = sorted({n for n in names if names.count(n) > 1})
            raise CorruptCheckpointError(f"{path}: the zip archive holds {', '.join(dup)} more than once; it is "
                                         "corrupt (torch never writes a record twice)")
        pkl = [n for n in names if n.endswith("/data.pkl") or n == "data.pkl"]
        if len(pkl) != 1:
            raise CorruptCheckpointError(f"{path}: zip archive without a single data.pkl; not a torch checkpoint")
        prefix = pkl[0][: -len("data.pkl")]
        byteorder = prefix + "byteorder"
        if byteorder in names and _read_member(zf, byteorder, path).strip() not in (b"little", b""):
            raise CorruptCheckpointError(f"{path}: big-endian checkpoints are not supported")
        infos = {i.filename: i for i in zf.infolist()}
        data = _read_member(zf, pkl[0], path, "max_pickle_nbytes")
    checked = crc.checks_enabled()
    info = FileInfo(prefix[:-1] or None, tuple(sorted((i.filename[len(prefix):], i.CRC, i.file_size)
                                                      for i in infos.values())))

    def resolve(args: tuple) -> StorageRef:
        storage_type, key, location, numel = args[:4]
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
        info = infos.get(f"{prefix}data/{key}")
        if info is None:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is missing from the archive")
        if info.compress_type != zipfile.ZIP_STORED:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is compressed; not a torch file")
        raw.seek(info.header_offset)
        header = raw.read(30)
        if len(header) < 30 or header[:4] != b"PK\x03\x04":
            raise CorruptCheckpointError(f"{path}: bad zip entry header for data/{key}")
        flags, local_crc = struct.unpack("<H", header[6:8])[0], struct.unpack("<I", header[14:18])[0]
        if not flags & 0x08 and local_crc != info.CRC:  # torch's writer leaves it 0 (bit 3: data descriptor)
            raise CorruptCheckpointError(crc.local_header_message(path, info.filename, info.CRC, local_crc))
        name_len, extra_len = struct.unpack("<HH", header[26:30])
        offset = info.header_offset + 30 + name_len + extra_len
        dtype = storage_type.dtype
        count = int(numel) if numel is not None else info.file_size // DTYPES[dtype].itemsize
        check = crc.RecordCheck(path, info.filename, info.CRC, info.file_size, offset) if checked else None
        ref = StorageRef(path, str(key), dtype, count, offset, str(location), info.filename, info.file_size,
                         info.CRC, check)
        if ref.nbytes > info.file_size:
            raise CorruptCheckpointError(f"{path}: storage data/{key} is shorter than its tensors")
        return ref

    cache: dict[str, StorageRef] = {}

    def resolve_cached(args: tuple) -> StorageRef:
        key = str(args[1])
        if key not in cache:
            cache[key] = resolve(args)
        return cache[key]

    stream = _BoundedReader(io.BytesIO(data), path, len(data))
    try:
        return _Unpickler(stream, path=path, resolve_storage=resolve_cached).load(), info
    except MemoryError as e:  # a BINBYTES length far beyond the in-memory pickle (CRC-checked, so hostile)
        raise CorruptCheckpointError(f"{path}: data.pkl asks for more memory than it holds; the file is "
                                     "corrupt or hostile") from e


def _read_member(zf: zipfile.ZipFile, name: str, path: Path, budget: str = "max_text_nbytes") -> bytes:
    """A small record (the pickle, ``byteorder``), read whole within ``budget`` (a :class:`limits.ReadLimits`
    field); :mod:`zipfile` checks its CRC-32. A compressed record (``torch.save`` never compresses) is
    inflated only up to ``max_inflated_nbytes``, whatever its header declares."""
    info = zf.getinfo(name)
    lim = limits.current()
    what = f"record '{name}'"
    try:
        if info.compress_type != zipfile.ZIP_STORED:
            bound = min(lim.max_inflated_nbytes, getattr(lim, budget))
            name_of = "max_inflated_nbytes" if bound == lim.max_inflated_nbytes else budget
            if info.file_size > bound:
                raise limits.exceeded(path, f"compressed {what} declares {info.file_size} bytes inflated", None,
                                      name_of)
            with zf.open(info) as member:
                data = member.read(bound + 1)
                if len(data) > bound:  # the header lied about the inflated size
                    raise limits.exceeded(path, f"compressed {what} inflates past {bound} bytes", None, name_of)
                member.read()  # the rest (none, if the header is right) and zipfile's CRC check
            return data
        if info.file_size > getattr(lim, budget):
            raise limits.exceeded(path, f"{what} of {info.file_size} bytes", None, budget)
        return zf.read(name)
    except zipfile.BadZipFile as e:
        if "CRC" not in str(e):
            raise
        raise CorruptCheckpointError(
            f"{path}: record '{name}' fails its CRC32 check; the file is damaged (bit rot or a bad copy) "
            "— restore it from a backup or use another tag") from e


_LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
_LEGACY_PROTOCOL = 1001


def _load_legacy(path: Path, raw_file: Any) -> Any:
    """The pre-zip format: magic, protocol, sys_info, main pickle, storage keys, raw storages."""
    raw_file.seek(0)
    f = _BoundedReader(raw_file, path)
    # The pickles come first: none of them may run past max_pickle_nbytes into the file.
    f.limit_end = limits.current().max_pickle_nbytes
    plain = _PlainUnpickler(f, path)
    if plain.load() != _LEGACY_MAGIC:
        raise CorruptCheckpointError(f"{path}: not a torch checkpoint (bad magic number)")
    if _PlainUnpickler(f, path).load() != _LEGACY_PROTOCOL:
        raise CorruptCheckpointError(f"{path}: unsupported legacy torch protocol version")
    sys_info = _PlainUnpickler(f, path).load()
    if isinstance(sys_info, dict) and not sys_info.get("little_endian", True):
        raise CorruptCheckpointError(f"{path}: big-endian checkpoints are not supported")

    placeholders: dict[str, _LegacyStorage] = {}

    def resolve(args: tuple) -> Any:
        storage_type, key, location, numel, view_metadata = args
        if not isinstance(storage_type, _StorageType):
            raise pickle.UnpicklingError(f"storage of unknown type {storage_type!r}")
        key = str(key)
        if key not in placeholders:
            placeholders[key] = _LegacyStorage(key, storage_type.dtype, int(numel), str(location))
        if view_metadata is not None:
            raise CorruptCheckpointError(f"{path}: legacy storage views are not supported")
        return placeholders[key]

    obj = _LegacyUnpickler(f, path=path, resolve_storage=resolve).load()
    keys = _PlainUnpickler(f, path).load()
    f.limit_end = None
    if not isinstance(keys, list) or len(keys) > limits.current().max_objects:
        raise CorruptCheckpointError(f"{path}: the storage key list is damaged")
    offset = f.tell()
    resolved: dict[str, StorageRef] = {}
    size = path.stat().st_size
    for key in keys:
        ph = placeholders[str(key)]
        f.seek(offset)
        (count,) = struct.unpack("<q", f.read(8))
        data_offset = offset + 8
        ref = StorageRef(path, ph.key, ph.dtype, int(count), data_offset, ph.location)
        if data_offset + ref.nbytes > size:
            raise CorruptCheckpointError(f"{path}: file ends inside storage {ph.key!r}; it is truncated")
        resolved[ph.key] = ref
        offset = data_offset + ref.nbytes
    return _replace_legacy(obj, resolved)


class _BoundedReader:
    """A file for the unpickler that refuses reads past its end before anything is allocated: a
    damaged or hostile length in the pickle stream (BINUNICODE8, BINBYTES8, ...; legacy files have no
    CRC) would otherwise ask for up to 2**63 bytes."""

    #: reads may not go past this offset (the pickle budget, ``max_pickle_nbytes``); None: no budget
    limit_end: int | None = None

    def __init__(self, f: Any, path: Path, size: int | None = None) -> None:
        self._f = f
        self._path = path
        self._size = os.fstat(f.fileno()).st_size if size is None else size

    def _check(self, n: int | None) -> None:
        if n is not None and n > self._size - self._f.tell():  # the more precise answer first
            raise CorruptCheckpointError(
                f"{self._path}: the pickle stream asks for {n} bytes at offset {self._f.tell()}, past the end "
                "of the file; it is corrupt")
        if n is not None and self.limit_end is not None and self._f.tell() + n > self.limit_end:
            raise limits.exceeded(self._path, f"a pickle running past byte {self.limit_end}", None,
                                  "max_pickle_nbytes")

    def read(self, n: int = -1) -> bytes:
        self._check(n if n is not None and n >= 0 else None)
        return self._f.read(n)

    def readinto(self, b: Any) -> int:
        return self._f.readinto(b)

    def peek(self, n: int = 0) -> bytes:  # lets the C unpickler prefetch instead of calling read() per opcode
        pos = self._f.tell()
        data = self._f.read(max(n, 1 << 16))
        self._f.seek(pos)
        return data

    def readline(self, limit: int = -1) -> bytes:
        return self._f.readline(limit)

    def seek(self, offset: int, whence: int = 0) -> int:
        return self._f.seek(offset, whence)

    def tell(self) -> int:
        return self._f.tell()


@dataclass(frozen=True)
class _LegacyStorage:
    key: str
    dtype: str
    numel: int
    location: str


class _PlainUnpickler(pickle._Unpickler):  # type: ignore[name-defined,misc]
    """For the legacy header pickles, which hold only plain Python values."""

    def __init__(self, file: Any, path: Path) -> None:
        super().__init__(file, encoding="utf-8")
        self._path = path

    def find_class(self, module: str, name: str) -> Any:
        raise UnsafeCheckpointError(f"{self._path}: refusing global '{module}.{name}' in a legacy header")


def _replace_legacy(obj: Any, resolved: dict[str, StorageRef]) -> Any:
    """Swap the placeholder storages that legacy tensors were built on for located ones."""

    def fix(x: Any) -> Any:
        if isinstance(x, TensorRef) and isinstance(x.storage, _LegacyStorage):  # type: ignore[unreachable]
            return TensorRef(resolved[x.storage.key], x.storage_offset, x.shape, x.stride,  # type: ignore[unreachable]
                             x.requires_grad, x.attrs)
        return x

    return map_structure(fix, obj)


# --------------------------------------------------------------------------------------------
# Walking loaded trees


def check_tree(obj: Any, where: object) -> None:
    """Refuse a parsed tree that goes past a :class:`dsckpt.limits.ReadLimits` budget: nesting depth (the
    longest chain of containers), distinct objects, references counted through every shared container
    (what a walk that forgot where it had been would visit), a container holding itself, integers of more
    than ``max_int_bits`` bits, strings and bytes of more than ``max_str_nbytes``.

    One iterative pass that visits each container once (a "billion laughs" memo costs its size on disk,
    not 10^9 visits); raises :class:`~dsckpt.limits.LimitExceededError` naming ``where`` and the limit."""
    lim = limits.current()
    # id -> (height, references) of every container finished; a container on the current path maps to None
    done: dict[int, tuple[int, int] | None] = {}
    objects = 0
    # (container, its children, index of the next child, height so far, references so far)
    stack: list[list[Any]] = []

    def leaf(x: Any) -> None:
        if isinstance(x, int) and x.bit_length() > lim.max_int_bits:  # bools are 1 bit
            raise limits.exceeded(where, f"an integer of {x.bit_length()} bits", None, "max_int_bits")
        if isinstance(x, (str, bytes, bytearray)) and len(x) > lim.max_str_nbytes:
            raise limits.exceeded(where, f"a {type(x).__name__} of {len(x)} characters/bytes", None,
                                  "max_str_nbytes")

    def enter(x: Any) -> tuple[int, int] | None:
        """(height, references) of ``x`` if known now (a leaf, a finished container); None once pushed."""
        nonlocal objects
        children = _children(x)
        key = id(x)
        if children is not None and key in done:
            known = done[key]
            if known is None:
                raise CorruptCheckpointError(f"{where}: a {type(x).__name__} in the pickle contains itself; no "
                                             "DeepSpeed checkpoint does, the file is corrupt or hostile")
            return known
        objects += 1  # a container once, a leaf (a number, a string: often shared, cheap to count) each time
        if objects > lim.max_objects:
            raise limits.exceeded(where, f"more than {lim.max_objects} objects in one pickle", None,
                                  "max_objects")
        if children is None:
            leaf(x)
            return (0, 1)
        if len(stack) >= lim.max_depth:
            raise limits.exceeded(where, f"containers nested more than {lim.max_depth} deep", None,
                                  "max_depth")
        done[key] = None
        stack.append([x, children, 0, 0, 1])
        return None

    if enter(obj) is not None:
        return
    while stack:
        top = stack[-1]
        children, i = top[1], top[2]
        if i < len(children):
            top[2] = i + 1
            got = enter(children[i])
            if got is not None:
                top[3] = max(top[3], got[0])
                top[4] += got[1]
            continue
        stack.pop()
        height, refs = top[3] + 1, top[4]
        if refs > lim.max_references:
            raise limits.exceeded(where, f"{refs} objects reached through shared references", None, "max_references")
        done[id(top[0])] = (height, refs)
        if stack:
            parent = stack[-1]
            parent[3] = max(parent[3], height)
            parent[4] += refs
        elif height > lim.max_depth:
            raise limits.exceeded(where, f"containers nested {height} deep", None, "max_depth")


def _children(x: Any) -> list[Any] | None:
    """The objects ``x`` holds (keys included), or None for a leaf."""
    if isinstance(x, dict):
        return [*x.keys(), *x.values()]
    if isinstance(x, (list, tuple, set, frozenset)):
        return list(x)
    if isinstance(x, DeepSpeedObject):
        return [*x.__dict__.keys(), *x.__dict__.values()]
    if isinstance(x, TensorRef):
        return [*x.attrs.keys(), *x.attrs.values()] if x.attrs else None
    if isinstance(x, np.ndarray) and x.dtype == object:
        return list(x.ravel())
    return None


def map_structure(fn: Callable[[Any], Any], obj: Any) -> Any:
    """Apply ``fn`` to every leaf of nested dicts/lists/tuples and stand-in attributes. A container shared by
    several parents (the pickle memo) is mapped once and stays shared."""
    memo: dict[int, Any] = {}

    def go(obj: Any) -> Any:
        key = id(obj)
        if key in memo:
            return memo[key]
        if isinstance(obj, OrderedDict):
            out: Any = OrderedDict((k, go(v)) for k, v in obj.items())
        elif isinstance(obj, dict):
            out = {k: go(v) for k, v in obj.items()}
        elif isinstance(obj, list):
            out = [go(v) for v in obj]
        elif isinstance(obj, tuple) and not isinstance(obj, TorchSize):
            mapped = [go(v) for v in obj]
            out = type(obj)(*mapped) if hasattr(obj, "_fields") else tuple(mapped)
        elif isinstance(obj, DeepSpeedObject):
            for k, v in list(obj.__dict__.items()):
                obj.__dict__[k] = go(v)
            out = obj
        else:
            return fn(obj)
        memo[key] = out
        return out

    return go(obj)


def walk_tensors(obj: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[tuple[Any, ...], TensorRef]]:
    """Every :class:`TensorRef` in a loaded tree with its key path, in a stable order. A container reached
    through several paths (the pickle memo shares it) is walked once; its tensors are listed under each
    path (the tree's reference budget, :func:`check_tree`, bounds how many that can be)."""
    memo: dict[int, list[tuple[tuple[Any, ...], TensorRef]]] = {}

    def visit(x: Any) -> list[tuple[tuple[Any, ...], TensorRef]]:
        if isinstance(x, TensorRef):
            return [((), x)]
        key = id(x)
        found = memo.get(key)
        if found is not None:
            return found
        if isinstance(x, dict):
            items: Any = x.items()
        elif isinstance(x, (list, tuple)) and not isinstance(x, TorchSize):
            items = enumerate(x)
        elif isinstance(x, DeepSpeedObject):
            items = x.__dict__.items()
        else:
            return []
        out = [((k, *p), ref) for k, v in items for p, ref in visit(v)]
        memo[key] = out
        return out

    return [((*prefix, *p), ref) for p, ref in visit(obj)]


def materialize(obj: Any) -> Any:
    """What ``torch.load`` would return: every :class:`TensorRef` read into a real CPU tensor and every
    torch stand-in (:class:`TorchSize` ...) turned into the torch object. Imports torch."""
    import torch

    cache: dict[tuple[Path, str], torch.Tensor] = {}

    def read(x: Any) -> Any:
        if not isinstance(x, TensorRef):
            return to_torch_value(x)
        skey = (x.storage.path, x.storage.key)
        if skey not in cache:
            whole = torch.empty(x.storage.numel, dtype=x.dtype)
            _read_bytes(x.storage, 0, x.storage.numel, _byte_view(whole.view(torch.uint8).numpy()))
            cache[skey] = whole
        storage = cache[skey]
        # Views of one storage stay views of one storage (tied weights, flat buffers).
        t = storage.as_strided(x.shape, x.stride, x.storage_offset) if x.numel else torch.empty(
            x.shape, dtype=x.dtype)
        if x.attrs:
            for k, v in x.attrs.items():
                setattr(t, k, v)
        return t

    return map_structure(read, obj)


def finish_checks(obj: Any) -> int:
    """Complete the CRC-32 checks of every zip record that tensors of the loaded tree ``obj`` were
    read from (bytes not yet read are read now; records never read are left alone).

    Raises :class:`CorruptCheckpointError` naming every damaged record. Returns the number of
    records verified."""
    return crc.finish(ref.storage.check for _, ref in walk_tensors(obj))
