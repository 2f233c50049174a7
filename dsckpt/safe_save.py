"""Writing DeepSpeed checkpoint files back (``repair``, ``reshard``) without importing deepspeed.

Files dsckpt rewrites contain the stand-ins of :mod:`dsckpt.safe_load` (``LossScaler``,
``ZeroStageEnum``, ``fragment_address`` ...). They must pickle under DeepSpeed's own class paths so
that ``engine.load_checkpoint()`` reads them as if DeepSpeed had written them. The standard pickler
would import ``deepspeed`` to check each class path; this one writes the recorded path as is.
"""

from __future__ import annotations

import os
import pickle
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar

import torch

from .atomic import atomic_file
from .stand_ins import DeepSpeedObject, TorchDevice, TorchDtype, TorchSize, to_torch_value

__all__ = ["pickle_module", "save"]


if TYPE_CHECKING:
    _PurePythonPickler = Any
else:
    # The pure-Python pickler: its save_global can be overridden (the C one's cannot).
    _PurePythonPickler = pickle._Pickler


class _Pickler(_PurePythonPickler):
    def save(self, obj: Any, save_persistent_id: bool = True) -> None:
        # Lazy trees hold torch.Size / dtypes / devices as stand-ins: write torch's own objects.
        if isinstance(obj, (TorchSize, TorchDtype, TorchDevice)):
            obj = to_torch_value(obj)
        super().save(obj, save_persistent_id)

    def save_global(self, obj: Any, name: str | None = None) -> None:
        if isinstance(obj, type) and issubclass(obj, DeepSpeedObject) and obj.ds_module:
            module, qualname = obj.ds_module, obj.ds_name
            if self.proto >= 4:
                self.save(module)
                self.save(qualname)
                self.write(pickle.STACK_GLOBAL)
            else:
                self.write(pickle.GLOBAL + module.encode("utf-8") + b"\n" + qualname.encode("utf-8") + b"\n")
            self.memoize(obj)
            return
        super().save_global(obj, name)

    dispatch: ClassVar = dict(pickle._Pickler.dispatch)  # type: ignore[attr-defined]  # private in typeshed


def _dump(obj: Any, file: Any, protocol: int | None = None, **_: Any) -> None:
    _Pickler(file, protocol).dump(obj)


#: A ``pickle_module`` for ``torch.save`` that writes stand-ins under DeepSpeed's class paths.
pickle_module = ModuleType("dsckpt_pickle")
pickle_module.Pickler = _Pickler  # type: ignore[attr-defined]
pickle_module.dump = _dump  # type: ignore[attr-defined]


def _refuse_load(*_: Any, **__: Any) -> Any:
    raise TypeError("dsckpt.safe_save.pickle_module writes only; read with dsckpt.safe_load.load")


# Writing only: loading through this module is refused (dsckpt.safe_load is the one reader).
pickle_module.Unpickler = _refuse_load  # type: ignore[attr-defined]
pickle_module.load = _refuse_load  # type: ignore[attr-defined]


def save(obj: Any, path: str | os.PathLike[str], *, legacy_format: bool = False) -> Path:
    """``torch.save`` ``obj`` to ``path`` atomically (zip format unless ``legacy_format``)."""
    path = Path(path)
    with atomic_file(path) as f:
        torch.save(obj, f, pickle_module=pickle_module,  # type: ignore[arg-type]
                   _use_new_zipfile_serialization=not legacy_format)
    return path
