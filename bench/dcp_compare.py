"""Exit 0 when two DCP folders hold the same keys, dtypes, shapes and values (bit for bit, NaN included), else
print what differs and exit 1. Loads the tensors a few at a time through ``dcp.load``.

    python bench/dcp_compare.py A B
"""

from __future__ import annotations

import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

warnings.filterwarnings("ignore", message="torch.distributed is disabled")


def main() -> int:
    a, b = sys.argv[1:3]
    ma = dcp.FileSystemReader(a).read_metadata().state_dict_metadata
    mb = dcp.FileSystemReader(b).read_metadata().state_dict_metadata
    if ma.keys() != mb.keys():
        print("keys differ:", sorted(set(ma) ^ set(mb))[:10])
        return 1
    bad = [k for k in ma if ma[k] != mb[k]]
    tensors = [k for k in ma if isinstance(ma[k], TensorStorageMetadata)]
    batch: list[str] = []
    nbytes = 0
    for i, k in enumerate(tensors):
        batch.append(k)
        nbytes += ma[k].size.numel() * ma[k].properties.dtype.itemsize
        if nbytes < 2 << 30 and i + 1 < len(tensors):
            continue
        sa = {k: torch.empty(ma[k].size, dtype=ma[k].properties.dtype) for k in batch}
        sb = {k: torch.empty(ma[k].size, dtype=ma[k].properties.dtype) for k in batch}
        dcp.load(sa, checkpoint_id=a, no_dist=True)
        dcp.load(sb, checkpoint_id=b, no_dist=True)
        bad += [k for k in batch if not torch.equal(sa[k].view(-1).view(torch.uint8), sb[k].view(-1).view(torch.uint8))]
        batch, nbytes = [], 0
    print(f"{len(tensors)} tensors, {len(ma) - len(tensors)} other items compared; differ: {bad[:10]}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
