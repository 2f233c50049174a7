"""Test-only compatibility shim: DeepSpeed 0.19.8's AutoEP on transformers 5.23.

DeepSpeed 0.19.8 (``module_inject/auto_ep_presets/base.py``) treats transformers' output-capture registry
``_CAN_RECORD_REGISTRY`` as a plain dict keyed by class-name strings: ``registry.get(key, default)``,
``registry[key] = entry``, ``registry.pop(key, None)``, ``registry.update(...)``. transformers 5.23 made it a
``_CanRecordRegistry(dict)`` whose ``get(model)`` and ``__setitem__(model, value)`` take a *model* and key it by
``str(model.__class__)`` (5.22.2: a plain dict), so AutoEP fails with ``_CanRecordRegistry.get() takes 2 positional
arguments but 3 were given``. :func:`apply` lets both accept a string key as well (a string is already the key;
anything else is keyed as transformers 5.23 does), which is exactly 5.22.2's behaviour for DeepSpeed's calls and
5.23's for transformers' own. Used by the check scripts that launch AutoEP engines (tests/ds_autoep_reshard_check.py);
the fixtures themselves were written with transformers 5.22.2 (tests/fixtures/generate_autoep.py).
"""
from __future__ import annotations


def apply() -> bool:
    """Patch transformers' registry class if it is 5.23's; returns whether it patched."""
    try:
        from transformers.utils import output_capturing
    except ImportError:
        return False
    cls = type(getattr(output_capturing, "_CAN_RECORD_REGISTRY", None))
    if cls is dict or not issubclass(cls, dict) or getattr(cls, "_dsckpt_autoep_shim", False):
        return False

    def _key(model_or_key):
        return model_or_key if isinstance(model_or_key, str) else str(model_or_key.__class__)

    def get(self, model_or_key, *default):
        if default:
            return dict.get(self, _key(model_or_key), *default)
        return dict.get(self, _key(model_or_key)) or {}

    def setitem(self, model_or_key, value):
        dict.__setitem__(self, _key(model_or_key), value)

    cls.get = get
    cls.__setitem__ = setitem
    cls._dsckpt_autoep_shim = True
    return True
