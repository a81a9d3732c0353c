"""A Hugging Face Trainer run the way its docs show (a tiny model built from a config
class, no download), DDP on CPU (gloo), with gradient accumulation and DataLoader
workers. Problems are injected by $FAULTS (see _faults.py).

    traceml run examples/frameworks/hf_trainer.py --nproc-per-node 3
"""

from __future__ import annotations

import argparse
import tempfile

import torch
from _faults import SyntheticData, TinyNet, report_steps, world
from torch.utils.data import SequentialSampler
from transformers import PretrainedConfig, PreTrainedModel, Trainer, TrainingArguments


class TinyConfig(PretrainedConfig):
    model_type = "traceml-tiny"

    def __init__(self, classes: int = 4, **kwargs) -> None:
        super().__init__(**kwargs)
        self.classes = classes


class TinyClassifier(PreTrainedModel):
    config_class = TinyConfig

    def __init__(self, config: TinyConfig) -> None:
        super().__init__(config)
        self.net = TinyNet(config.classes)
        self.loss_fn = torch.nn.CrossEntropyLoss()
        self.post_init()

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None):
        logits = self.net(x)
        loss = None if labels is None else self.loss_fn(logits, labels)
        return {"loss": loss, "logits": logits}


class Pairs(SyntheticData):
    def __getitem__(self, i: int):
        x, y = super().__getitem__(i)
        return {"x": x, "labels": y}


class InOrderTrainer(Trainer):
    """Batches in dataset order (sharded across ranks by Accelerate), so the injected
    faults land on the micro-batches the schedule names."""

    def _get_train_sampler(self, *args, **kwargs):
        return SequentialSampler(self.train_dataset)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=200, help="optimizer steps")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--accumulate", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    args = p.parse_args()

    micro = args.steps * args.accumulate
    data = Pairs(micro * args.batch * world(), args.batch)
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-trainer-"), per_device_train_batch_size=args.batch,
        gradient_accumulation_steps=args.accumulate, dataloader_num_workers=args.workers,
        max_steps=args.steps, use_cpu=True, ddp_backend="gloo", report_to=[],
        save_strategy="no", logging_strategy="no", disable_tqdm=True, learning_rate=1e-3)
    trainer = InOrderTrainer(model=TinyClassifier(TinyConfig()), args=targs, train_dataset=data)
    trainer.train()
    report_steps(trainer.state.global_step)


if __name__ == "__main__":
    main()
