"""The route people take today from a DeepSpeed ZeRO checkpoint to a PyTorch DCP folder, for bench/dcp.py:
DeepSpeed's ``ds_to_universal`` first, then this script, which builds ``{"model": ..., "optim": ...}`` as
``get_model_state_dict`` / ``get_optimizer_state_dict`` give them from the universal folder's per-param files and
calls ``dcp.save``. Everything is loaded before the save (what such a script does: DCP saves a state dict).

    python bench/dcp_from_universal.py UNIVERSAL_DIR OUT_DIR

Reads DeepSpeed's own pickles with ``torch.load(weights_only=False)``: the benchmark's own, trusted checkpoint, read
as the user's script it stands for reads it (the anchor must not use dsckpt, whose one unpickling choke point is
``dsckpt/safe_load.py``).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp


def main() -> None:
    univ, out = Path(sys.argv[1]), Path(sys.argv[2])
    opt = torch.load(univ / "zero" / "optimizer_state.pt", weights_only=False)
    ms = torch.load(min(univ.glob("*model_states.pt")), weights_only=False)
    shapes = ms["param_shapes"]
    shapes = shapes if isinstance(shapes, list) else [shapes]
    state0 = next(iter(opt["optimizer_state_dict"]["state"].values()))
    step = float(state0["step"])
    model, state, groups = {}, {}, []
    for g, group_shapes in zip(opt["param_groups"], shapes):
        names = []
        for name, shape in group_shapes.items():
            d = univ / "zero" / name
            t = {}
            for key in ("fp32", "exp_avg", "exp_avg_sq"):
                v = torch.load(d / f"{key}.pt", weights_only=False)
                v = v["param"] if isinstance(v, dict) else v
                t[key] = v.reshape(shape)
            model[name] = t["fp32"]
            state[name] = {"step": torch.tensor(step), "exp_avg": t["exp_avg"], "exp_avg_sq": t["exp_avg_sq"]}
            names.append(name)
        groups.append({**{k: v for k, v in g.items() if k != "params"}, "params": names})
    dcp.save({"model": model, "optim": {"state": state, "param_groups": groups}}, checkpoint_id=str(out), no_dist=True)


if __name__ == "__main__":
    main()
