"""Run by torchrun (2 gloo CPU ranks) from tests/test_to_dcp.py: ``dcp_fsdp_check.py ROOT NAME...``.

For each fixture NAME, FSDP2 ``fully_shard`` (on ``init_device_mesh("cpu", (world,))``) wraps the fixture's model,
the job loads ``ROOT/NAME`` (a to-dcp folder) through dcp.load + set_state_dict, compares every gathered param,
buffer, moment, step and group hyper-parameter with the recorded truth exactly (tests/dcp_check.compare), then
trains one more step; rank 0 prints ``NAME: ok loss L`` or the differences.
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard

sys.path.insert(0, str(Path(__file__).parent))
import dcp_check


def main() -> int:
    root, names = Path(sys.argv[1]), sys.argv[2:]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,))
    failed = 0
    for name in names:
        def shard(model: torch.nn.Module) -> None:
            for module in (model.fc1, model.fc2):
                fully_shard(module, mesh=mesh)
            fully_shard(model, mesh=mesh)

        model, opt = dcp_check.build(name, shard)
        groups = dcp_check.group_truth(opt)
        dcp_check.load(model, opt, root / name)
        bad = dcp_check.compare(name, model, opt, groups)
        # the same batch on every rank: the loss equals the one-process loss of the same state
        loss = dcp_check.one_more_step(name, model, opt, rank=0)
        losses = [None] * world
        dist.all_gather_object(losses, loss)
        if len(set(losses)) != 1:
            bad.append(f"losses differ across ranks: {losses}")
        plain_model, plain_opt = dcp_check.build(name)
        dcp_check.load(plain_model, plain_opt, root / name)
        plain = dcp_check.one_more_step(name, plain_model, plain_opt)
        if abs(plain - loss) > 1e-6 * abs(plain):
            bad.append(f"FSDP2 loss {loss} vs one process {plain}")
        if rank == 0:
            print(f"{name}: ok loss {loss:.6f}" if not bad else f"{name}: FAILED {bad}", flush=True)
        failed += bool(bad)
    dist.destroy_process_group()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
