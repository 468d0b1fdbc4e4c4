"""One rank of tests/test_lightning.py: ``python -m tests.lightning_worker SCENARIO OUT``.

The parent sets the variables that make Lightning treat this process as launched from
outside (``LOCAL_RANK``, ``NODE_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``); Lightning creates
the process group itself, in the first run's strategy. Each scenario trains the same model
from the same weights and batches once per strategy, one after the other in this process,
and saves what each run left (parameters and buffers, losses, what the strategy saw) to
``OUT/SCENARIO.rank<N>.pt`` for the parent to compare.
"""

from __future__ import annotations

import os
import sys
import warnings
from datetime import timedelta
from typing import Any, Callable, Dict, List

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import lightning.pytorch as pl
from lightning.fabric.plugins.environments import LightningEnvironment
from lightning.pytorch.callbacks import GradientAccumulationScheduler
from lightning.pytorch.strategies import DDPStrategy

from bytescheduler import SchedulerClosed
from bytescheduler.lightning import ScheduledStrategy

WAIT = 60  # seconds: the scheduler's timeout and the process group's
PG_TIMEOUT = timedelta(seconds=WAIT)


class Net(pl.LightningModule):
    """A small MLP (a 4 KiB layer, cut into pieces at partition_bytes="1KiB"), SGD with
    momentum and a per-step LR schedule, or Adam with a per-epoch one; BatchNorm optionally."""

    def __init__(self, optimizer: str = "sgd", batchnorm: bool = False, manual: bool = False) -> None:
        super().__init__()
        torch.manual_seed(0)  # the same weights in every run (and rank 0's are broadcast anyway)
        layers: List[nn.Module] = [nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 32)]
        if batchnorm:
            layers.append(nn.BatchNorm1d(32))
        layers += [nn.ReLU(), nn.Linear(32, 3)]
        self.net = nn.Sequential(*layers)
        self.optimizer_name = optimizer
        self.automatic_optimization = not manual
        self.losses: List[torch.Tensor] = []
        self.seen: List[Dict[str, Any]] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self.net(x), y)  # a submodule, not self(x): DDP's forward still runs around it
        self.losses.append(loss.detach().clone())
        if not self.automatic_optimization:
            optimizer = self.optimizers()
            optimizer.zero_grad()
            self.manual_backward(loss)
            optimizer.step()
            self.lr_schedulers().step()
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        loss = F.cross_entropy(self(x), y)
        self.log("val_loss", loss, sync_dist=True)

    def test_step(self, batch, batch_idx):
        x, y = batch
        self.log("test_loss", F.cross_entropy(self(x), y), sync_dist=True)

    def configure_optimizers(self):
        if self.optimizer_name == "adam":
            optimizer = torch.optim.Adam(self.parameters(), lr=0.01)
            scheduler = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 1, gamma=0.5), "interval": "epoch"}
        else:
            optimizer = torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            scheduler = {"scheduler": torch.optim.lr_scheduler.StepLR(optimizer, 2, gamma=0.5), "interval": "step"}
        return {"optimizer": optimizer, "lr_scheduler": scheduler}

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        strategy = self.trainer.strategy
        optimizer = self.trainer.optimizers[0]
        self.seen.append({
            "ddp": isinstance(strategy.model, torch.nn.parallel.DistributedDataParallel),
            "scheduled": hasattr(optimizer, "_bytescheduler"),
            "optimizer_class": isinstance(optimizer, (torch.optim.SGD, torch.optim.Adam)),
            "scheduler_follows": self.trainer.lr_scheduler_configs[0].scheduler.optimizer is optimizer,
            "lr": optimizer.param_groups[0]["lr"],
        })
        self._last_optimizer = optimizer


def loader(rank_data_seed: int, batches: int, batch: int = 4, world: int = 2) -> DataLoader:
    """``batches`` batches per rank (Lightning adds the DistributedSampler: rank r reads every other sample)."""
    generator = torch.Generator().manual_seed(rank_data_seed)
    count = batches * batch * world
    x = torch.randn(count, 8, generator=generator)
    y = torch.randint(0, 3, (count,), generator=generator)
    return DataLoader(TensorDataset(x, y), batch_size=batch, shuffle=False)


def trainer(strategy: pl.strategies.Strategy, **kwargs: Any) -> pl.Trainer:
    options = dict(accelerator="cpu", devices=2, num_nodes=1, strategy=strategy, plugins=[LightningEnvironment()],
                   max_epochs=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                   enable_model_summary=False, num_sanity_val_steps=0)
    options.update(kwargs)
    return pl.Trainer(**options)


def strategies(out: str, scenario: str) -> Dict[str, Callable[[], pl.strategies.Strategy]]:
    """The runs of a scenario: ours first, so that Lightning creates the process group in ours."""
    def timeline(name: str) -> str:
        return os.path.join(out, f"{scenario}-{name}.json")

    return {
        "scheduled": lambda: ScheduledStrategy(adaptive=False, partition_bytes="1KiB", timeline=timeline("scheduled"),
                                               timeout=WAIT, process_group_timeout=PG_TIMEOUT),
        "scheduled-defaults": lambda: ScheduledStrategy(process_group_timeout=PG_TIMEOUT),
        "hook": lambda: ScheduledStrategy("hook", adaptive=False, partition_bytes="1KiB", bucket_cap_mb=0.002,
                                          timeline=timeline("hook"), timeout=WAIT, process_group_timeout=PG_TIMEOUT),
        "ddp": lambda: DDPStrategy(process_group_backend="gloo", bucket_cap_mb=0.002, timeout=PG_TIMEOUT),
    }


def snapshot(model: Net) -> Dict[str, Any]:
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "losses": [loss.item() for loss in model.losses], "loss_tensors": list(model.losses)}


def closed_after_fit(trainer_: pl.Trainer, model: Net) -> Dict[str, Any]:
    """What the strategy holds once fit returned, and whether the optimizer it trained with still steps."""
    strategy = trainer_.strategy
    state = {"held": bool(getattr(strategy, "_scheduled", [])) or getattr(strategy, "hook_state", None) is not None}
    optimizer = getattr(model, "_last_optimizer", None)
    if optimizer is not None and hasattr(optimizer, "_bytescheduler"):
        try:
            optimizer.step()
            state["step_after_close"] = "stepped"
        except SchedulerClosed:
            state["step_after_close"] = "closed"
    return state


# ------------------------------------------------------------------------- scenarios


def basic(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """Two epochs of four steps, SGD with momentum, the LR halved every two steps."""
    model = Net()
    run = trainer(make())
    run.fit(model, loader(1, 4))
    return {**snapshot(model), "seen": model.seen, "after": closed_after_fit(run, model)}


def accumulate_clip(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """Adam, two batches accumulated per step: with gradient norms clipped at 0.05 (four
    batches per epoch), and without clipping, five batches per epoch (each epoch ends
    with a step after one batch)."""
    results = {}
    for stage, clip, batches in (("clip", 0.05, 4), ("partial", None, 5), ("scheduled-accumulation", None, 4)):
        model = Net("adam")
        if stage == "scheduled-accumulation":  # one batch per step in the first epoch, two in the second
            run = trainer(make(), callbacks=[GradientAccumulationScheduler({0: 1, 1: 2})])
        else:
            run = trainer(make(), accumulate_grad_batches=2, gradient_clip_val=clip)
        run.fit(model, loader(2, batches))
        results[stage] = {**snapshot(model), "after": closed_after_fit(run, model)}
    return results


def partial_clip(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """Both at once: clipping in a step after one of two accumulated batches."""
    model = Net("adam")
    run = trainer(make(), accumulate_grad_batches=2, gradient_clip_val=0.05)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        run.fit(model, loader(2, 5))
    return {**snapshot(model), "warnings": [str(w.message) for w in caught]}


def manual(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """Manual optimization: zero_grad, manual_backward, step and the LR scheduler in training_step."""
    model = Net(manual=True)
    run = trainer(make())
    run.fit(model, loader(3, 4))
    return {**snapshot(model), "seen": model.seen, "after": closed_after_fit(run, model)}


def lifecycle(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """BatchNorm; fit with validation, validate, test, a checkpoint, fit again on the same
    Trainer (one more epoch, no validation), then a new Trainer resumed from the checkpoint."""
    train, val = loader(4, 3), loader(5, 2)
    model = Net(batchnorm=True)
    run = trainer(make(), max_epochs=1)
    run.fit(model, train, val)
    first = snapshot(model)
    after_first = closed_after_fit(run, model)
    validated = run.validate(model, val, verbose=False)
    tested = run.test(model, val, verbose=False)
    checkpoint = os.path.join(out, f"lifecycle-{name}.ckpt")
    run.save_checkpoint(checkpoint)
    run.fit_loop.max_epochs = 2
    run.fit(model, train)  # no validation: the buffers are those the training forwards left
    again = snapshot(model)
    resumed_model = Net(batchnorm=True)
    resumed = trainer(make(), max_epochs=2)
    resumed.fit(resumed_model, train, ckpt_path=checkpoint)
    return {"first": first, "after_first": after_first, "validated": validated, "tested": tested,
            "again": again, "after_again": closed_after_fit(run, model), "resumed": snapshot(resumed_model),
            "seen": model.seen + resumed_model.seen}


class Failing(Net):
    """Raises in the training step of batch 6 (the second epoch's third), on every rank."""

    def training_step(self, batch, batch_idx):
        if self.trainer.global_step == 6:
            raise RuntimeError("a failure in training_step")
        return super().training_step(batch, batch_idx)


def exception(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """A fit that fails on every rank at one step, then a new fit in the same processes."""
    failing = Failing()
    run = trainer(make())
    try:
        run.fit(failing, loader(6, 4))
        raised = None
    except RuntimeError as error:
        raised = str(error)
    after = closed_after_fit(run, failing)
    refused = None
    if name == "scheduled":  # an optimizer that evaluates its closure several times
        lbfgs = LBFGSNet()
        try:
            trainer(make()).fit(lbfgs, loader(6, 4))
        except ValueError as error:
            refused = str(error)
    model = Net()
    again = trainer(make())
    again.fit(model, loader(6, 4))
    return {"raised": raised, "after": after, "failed": snapshot(failing), "again": snapshot(model),
            "lbfgs": refused}


class LBFGSNet(Net):
    def configure_optimizers(self):
        return torch.optim.LBFGS(self.parameters(), lr=0.1)


HF_VOCAB, HF_LENGTH = 32, 8


class HFNet(pl.LightningModule):
    """A Hugging Face GPT-2 (tied embeddings) or BERT built from its config (tests/hf_models.py;
    dropout off: the runs follow each other in one process), AdamW with transformers' linear
    warm-up schedule, stepped per batch; its loss is the model's own (labels = the inputs)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        from tests import hf_models  # imports transformers: only in this scenario

        self.inner = getattr(hf_models, kind)(HF_VOCAB, dropout=False)
        self.losses: List[torch.Tensor] = []

    def training_step(self, batch, batch_idx):
        (tokens,) = batch
        loss = self.inner(input_ids=tokens, labels=tokens).loss
        self.losses.append(loss.detach().clone())
        return loss

    def on_train_batch_end(self, outputs, batch, batch_idx) -> None:
        self._last_optimizer = self.trainer.optimizers[0]

    def configure_optimizers(self):
        import transformers

        optimizer = torch.optim.AdamW(self.parameters(), lr=0.01, weight_decay=0.01)
        schedule = transformers.get_linear_schedule_with_warmup(optimizer, num_warmup_steps=2, num_training_steps=8)
        return {"optimizer": optimizer, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}


def huggingface(name: str, make: Callable, out: str) -> Dict[str, Any]:
    """GPT-2 and BERT, two epochs of three steps; BERT's gradient norms clipped at 0.5."""
    results = {}
    for kind, clip in (("gpt2", None), ("bert", 0.5)):
        generator = torch.Generator().manual_seed(7)
        tokens = torch.randint(0, HF_VOCAB, (3 * 4 * 2, HF_LENGTH), generator=generator)
        model = HFNet(kind)
        run = trainer(make(), gradient_clip_val=clip)
        run.fit(model, DataLoader(TensorDataset(tokens), batch_size=4, shuffle=False))
        results[kind] = {**snapshot(model), "after": closed_after_fit(run, model)}
    return results


SCENARIOS = {
    "basic": (basic, ["scheduled", "scheduled-defaults", "hook", "ddp"]),
    "accumulate_clip": (accumulate_clip, ["scheduled", "hook", "ddp"]),
    "partial_clip": (partial_clip, ["scheduled", "hook", "ddp"]),
    "manual": (manual, ["scheduled", "ddp"]),
    "lifecycle": (lifecycle, ["scheduled", "hook", "ddp"]),
    "exception": (exception, ["scheduled", "hook", "ddp"]),
    "huggingface": (huggingface, ["scheduled", "hook", "ddp"]),
}


def main(scenario: str, out: str) -> None:
    torch.set_num_threads(1)
    run, names = SCENARIOS[scenario]
    makers = strategies(out, scenario)
    results = {name: run(name, makers[name], out) for name in names}
    rank = torch.distributed.get_rank()
    torch.save(results, os.path.join(out, f"{scenario}.rank{rank}.pt"))
    torch.distributed.barrier()
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
