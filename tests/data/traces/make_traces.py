"""Record the real CPU traces that tests/report/test_trace_analysis.py reads.

    python tests/data/traces/make_traces.py

Runs a 2-rank gloo DDP job under torch.distributed.run: a tiny model, a DataLoader,
torch.profiler with schedule(wait=0, warmup=1, active=3), so each trace holds steps 1-3
(~170 KB). Rank 1 is an input straggler: its dataset sleeps STRAGGLER_SLEEP_S per sample,
so its DataLoader takes >= 8 * 2 ms per step and rank 0 waits for it in the AllReduce.
Rank 0 is written as plain JSON, rank 1 gzipped, so both readers are exercised.
"""

from __future__ import annotations

import gzip
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
BATCH = 8
STRAGGLER_SLEEP_S = 0.002


def _train() -> None:
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.profiler import ProfilerActivity, profile, schedule
    from torch.utils.data import DataLoader, Dataset

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)

    class Samples(Dataset):
        def __len__(self) -> int:
            return 64

        def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
            if rank == 1:
                time.sleep(STRAGGLER_SLEEP_S)
            return torch.full((16,), float(i)), torch.ones(1)

    model = nn.parallel.DistributedDataParallel(
        nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Linear(32, 1)))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    loader = DataLoader(Samples(), batch_size=BATCH)
    out = HERE / f"cpu_rank{rank}.json"

    def export(prof: profile) -> None:
        prof.export_chrome_trace(str(out))

    with profile(activities=[ProfilerActivity.CPU], on_trace_ready=export,
                 schedule=schedule(wait=0, warmup=1, active=3)) as prof:
        for step, (x, y) in enumerate(loader):
            if step == 4:
                break
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            prof.step()
    dist.destroy_process_group()
    if rank == 1:
        with open(out, "rb") as src, gzip.open(out.with_suffix(".json.gz"), "wb") as dst:
            shutil.copyfileobj(src, dst)
        out.unlink()


def main() -> None:
    if "LOCAL_RANK" in os.environ:
        _train()
        return
    subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", "2", __file__], check=True)
    for path in sorted(HERE.glob("cpu_rank*")):
        print(f"{path.name}: {path.stat().st_size / 1024:.0f} KB")


if __name__ == "__main__":
    main()
