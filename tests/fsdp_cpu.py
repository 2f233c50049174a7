"""Accelerate's FSDP path on CPU ranks, for the FSDP2 resume checks (tests/trainer_fsdp_check.py,
tests/accelerate_fsdp_check.py). Test-only.

accelerate 1.15 (state.py ``AcceleratorState.__init__``) switches to ``DistributedType.FSDP`` only for device
backends (MULTI_GPU, MULTI_XPU, ...): on CPU ranks (``MULTI_CPU``, gloo) an FSDP plugin is silently ignored and the
Trainer trains with DDP (seen: ``is_fsdp_enabled`` False, no ``pytorch_model_fsdp_0`` written). FSDP2 itself runs on
CPU (``fully_shard`` on a ``cpu`` device mesh), so :func:`allow_fsdp_on_cpu` makes that one switch where the plugin
was given, exactly as the GPU branch does; everything after it (``fsdp2_prepare_model``, ``save_fsdp_model``,
``load_fsdp_model``, ``load_fsdp_optimizer``) is Accelerate's own code.
"""
from __future__ import annotations


def allow_fsdp_on_cpu() -> None:
    import accelerate.state as st
    from accelerate.utils import DistributedType

    init = st.AcceleratorState.__init__

    def patched(self, *args, fsdp_plugin=None, **kwargs):  # type: ignore[no-untyped-def]
        init(self, *args, fsdp_plugin=fsdp_plugin, **kwargs)
        if fsdp_plugin is not None and self.distributed_type == DistributedType.MULTI_CPU:
            self.distributed_type = DistributedType.FSDP
            if self._mixed_precision != "no":
                fsdp_plugin.set_mixed_precision(self._mixed_precision)
            self.fsdp_plugin = fsdp_plugin
            st.PartialState._shared_state["distributed_type"] = self.distributed_type  # as state.py does after it

    st.AcceleratorState.__init__ = patched
