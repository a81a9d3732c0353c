"""A PyTorch Lightning model trained the way Lightning's docs show, DDP on CPU (gloo).
Problems are injected by $FAULTS (see _faults.py).

    traceml run examples/frameworks/lightning_train.py --nproc-per-node 3
    traceml run examples/frameworks/lightning_train.py --nproc-per-node 3 -- --manual
    traceml run examples/frameworks/lightning_train.py --nproc-per-node 3 -- --accumulate 2

Automatic optimization (the default) runs training_step and the backward inside
optimizer.step(closure); manual optimization calls manual_backward and opt.step()
inside training_step, which Lightning runs inside the DDP module's forward.
"""

from __future__ import annotations

import argparse
import os

import lightning as L
import torch
from _faults import SyntheticData, TinyNet, rank, report_steps, world
from torch.utils.data import DataLoader
from torch.utils.data.distributed import DistributedSampler


class Classifier(L.LightningModule):
    def __init__(self, manual: bool) -> None:
        super().__init__()
        self.net = TinyNet()
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.automatic_optimization = not manual

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = self.loss_fn(self(x), y)
        if self.automatic_optimization:
            return loss
        opt = self.optimizers()
        opt.zero_grad()
        self.manual_backward(loss)
        opt.step()
        return None

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.01)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--manual", action="store_true")
    p.add_argument("--accumulate", type=int, default=1)
    args = p.parse_args()

    micro = args.steps * args.accumulate
    data = SyntheticData(micro * args.batch * world(), args.batch)
    loader = DataLoader(data, batch_size=args.batch,
                        sampler=DistributedSampler(data, num_replicas=world(), rank=rank(),
                                                   shuffle=False))
    trainer = L.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // int(
            os.environ.get("LOCAL_WORLD_SIZE", "1")),
        strategy="ddp", max_steps=args.steps, max_epochs=1,
        accumulate_grad_batches=1 if args.manual else args.accumulate,
        use_distributed_sampler=False, logger=False, enable_checkpointing=False,
        enable_progress_bar=False, enable_model_summary=False, num_sanity_val_steps=0)
    trainer.fit(Classifier(args.manual), loader)
    report_steps(trainer.global_step)


if __name__ == "__main__":
    main()
