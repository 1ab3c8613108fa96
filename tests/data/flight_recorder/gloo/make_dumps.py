"""Writes rank_0 and rank_1 beside this file: the flight recorder of a 2-rank gloo job (torch >= 2.10 records gloo
collectives too) in which rank 1 never joins rank 0's fourth all-reduce, each rank dumping its ring buffer where
a cell's rank would (TORCH_FR_DUMP_TEMP_FILE's prefix `rank_`). Run: python make_dumps.py (about 5 s)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent


def rank(r: int) -> None:
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import _dump_fr_trace

    dist.init_process_group("gloo", rank=r, world_size=2)
    for _ in range(3):  # the steps both ranks took
        dist.all_reduce(torch.ones(4))
    if r == 0:  # rank 1 has left the loop: rank 0 waits in an all-reduce it never joins
        dist.all_reduce(torch.ones(4), async_op=True)
    (HERE / f"rank_{r}").write_bytes(_dump_fr_trace())
    os._exit(0)


if __name__ == "__main__":
    if len(sys.argv) > 1:
        rank(int(sys.argv[1]))
    else:
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533", "TORCH_FR_BUFFER_SIZE": "2000"}
        procs = [subprocess.Popen([sys.executable, __file__, str(r)], env=env) for r in (0, 1)]
        sys.exit(max(p.wait() for p in procs))
