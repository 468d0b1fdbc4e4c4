"""One rank of tests/test_huggingface.py: ``python -m tests.huggingface_worker SCENARIO OUT``.

The parent sets the variables of an external launcher (``RANK``, ``WORLD_SIZE``,
``LOCAL_RANK``, ``MASTER_ADDR``, ``MASTER_PORT``), as ``accelerate launch`` and ``torchrun``
do; Accelerate creates the gloo process group itself. Each scenario trains the same Hugging
Face model (built from its config: no download) from the same weights and batches once per
system, one after the other in this process, and saves what each run left (parameters,
buffers, losses) to ``OUT/SCENARIO.rank<N>.pt`` for the parent to compare.
"""

from __future__ import annotations

import os
import sys
import warnings

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # models from their configs: nothing to download
from typing import Any, Dict, List

import torch
from torch.utils.data import DataLoader, Dataset

import accelerate
import transformers
from accelerate.utils import DistributedDataParallelKwargs

import bytescheduler.accelerate as bsa
from bytescheduler import SchedulerClosed
from bytescheduler.transformers import ScheduledCallback, schedule
from tests import hf_models

WAIT = 60  # seconds: the scheduler's timeout
VOCAB, LENGTH = 256, 16


MODELS = {"gpt2": lambda: hf_models.gpt2(VOCAB), "bert": lambda: hf_models.bert(VOCAB)}


class Tokens(Dataset):
    """Random token sequences; labels are the inputs (GPT-2 shifts them; BERT predicts them)."""

    def __init__(self, count: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (count, LENGTH), generator=generator)

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> Dict[str, torch.Tensor]:
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def snapshot(model: torch.nn.Module, losses: List[torch.Tensor]) -> Dict[str, Any]:
    return {"state": {k: v.detach().clone() for k, v in model.state_dict().items()},
            "loss_tensors": [loss.detach().clone() for loss in losses]}


# --------------------------------------------------------------------------- Accelerate


def accelerate_loop(system: str, out: str, scenario: str, model_name: str) -> Dict[str, Any]:
    """Accelerate's documented loop: accumulate(2), backward, clip_grad_norm_, step, an LR schedule.

    Two epochs of four batches with the gradient norm clipped, then one of five (its last
    step after one batch: the end of the data loader) without clipping."""
    accelerator = accelerate.Accelerator(cpu=True, gradient_accumulation_steps=2,
                                         kwargs_handlers=[DistributedDataParallelKwargs(bucket_cap_mb=1)])
    model = MODELS[model_name]()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))
    loader = DataLoader(Tokens(32, seed=1), batch_size=4, shuffle=False)  # 4 batches per rank
    short = DataLoader(Tokens(40, seed=2), batch_size=4, shuffle=False)  # 5: a step after one batch
    options = dict(adaptive=False, partition_bytes="16KiB", timeout=WAIT,
                   timeline=os.path.join(out, f"{scenario}-{system}.json"))
    if system == "ddp":
        model, optimizer, loader, short, scheduler = accelerator.prepare(model, optimizer, loader, short, scheduler)
    else:
        model, optimizer, loader, short, scheduler = bsa.prepare(accelerator, model, optimizer, loader, short,
                                                                 scheduler, adapter=system, **options)
    seen = {"ddp": isinstance(model, torch.nn.parallel.DistributedDataParallel),
            "scheduled": hasattr(optimizer.optimizer, "_bytescheduler")}
    losses: List[torch.Tensor] = []
    lrs: List[float] = []
    torch.manual_seed(10 + accelerator.process_index)  # dropout: the same draws in every system
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for epoch in range(3):
            model.train()
            for batch in loader if epoch < 2 else short:
                with accelerator.accumulate(model):
                    loss = model(**batch).loss
                    losses.append(loss.detach().clone())
                    accelerator.backward(loss)
                    if accelerator.sync_gradients and epoch < 2:
                        accelerator.clip_grad_norm_(model.parameters(), 0.5)
                    optimizer.step()
                    scheduler.step()
                    optimizer.zero_grad()
                    lrs.append(optimizer.param_groups[0]["lr"])
        model.eval()
        with torch.no_grad():
            evaluation = model(**next(iter(loader))).loss.detach().clone()
        checkpoint = os.path.join(out, f"{scenario}-{system}-state.rank{accelerator.process_index}")
        accelerator.save_state(checkpoint)
        result = snapshot(accelerator.unwrap_model(model), losses)
        if system == "optimizer":  # the last run: end_training closes the scheduler, then the group
            accelerator.end_training()
        else:
            bsa.close(accelerator)
    result.update(seen=seen, lrs=lrs, evaluation=evaluation,
                  warnings=[str(w.message) for w in caught if "lr_scheduler" in str(w.message)])
    if system == "optimizer":
        try:
            optimizer.optimizer.step()
            result["step_after_close"] = "stepped"
        except SchedulerClosed:
            result["step_after_close"] = "closed"
    return result


# ------------------------------------------------------------------------------ Trainer


class Record(transformers.TrainerCallback):
    """Every logged training loss (one per step: logging_steps=1)."""

    def __init__(self) -> None:
        self.losses: List[float] = []

    def on_log(self, args, state, control, logs=None, **kwargs):
        if logs and "loss" in logs:
            self.losses.append(logs["loss"])


def trainer_run(system: str, out: str, scenario: str, model_name: str) -> Dict[str, Any]:
    """Trainer with accumulation 2, clipping, a linear schedule with warm-up; train() twice on one Trainer."""
    model = MODELS[model_name]()
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, f"{scenario}-{system}-trainer"), per_device_train_batch_size=4,
        gradient_accumulation_steps=2, num_train_epochs=2, learning_rate=1e-3, warmup_steps=2,
        max_grad_norm=0.5, logging_steps=1, save_strategy="no", report_to=[], use_cpu=True, seed=0,
        data_seed=0, dataloader_num_workers=0, disable_tqdm=True, ddp_bucket_cap_mb=1,
        ddp_find_unused_parameters=model_name == "bert")
    record = Record()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(48, seed=2), callbacks=[record])
    if system == "scheduled":
        schedule(trainer, adaptive=False, partition_bytes="16KiB", timeout=WAIT,
                 timeline=os.path.join(out, f"{scenario}-{system}.json"))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
        first = snapshot(model, [])
        trainer.args.num_train_epochs = 3
        trainer.train(resume_from_checkpoint=None)  # again: the same DDP, a new scheduler
    callback = next((c for c in trainer.callback_handler.callbacks if isinstance(c, ScheduledCallback)), None)
    return {**snapshot(model, []), "first": first, "losses": record.losses,
            "ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
            "slots": 0 if callback is None else len(callback.slots),
            "closed": None if callback is None else all(slot.state.closed for slot in callback.slots),
            "warnings": [str(w.message) for w in caught if "bytescheduler" in str(w.message)]}


def trainer_too_late(system: str, out: str, scenario: str, model_name: str) -> Dict[str, Any]:
    """schedule() after a first train(): the Trainer keeps the DDP it made then (without the
    hook), so the next train() averages without bytescheduler, and its first step warns."""
    args = transformers.TrainingArguments(
        output_dir=os.path.join(out, f"{scenario}-trainer"), per_device_train_batch_size=4, max_steps=2,
        report_to=[], use_cpu=True, save_strategy="no", disable_tqdm=True)
    trainer = transformers.Trainer(model=MODELS["gpt2"](), args=args, train_dataset=Tokens(16, seed=3))
    trainer.train()
    schedule(trainer, timeout=WAIT)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.train()
    return {"warnings": [str(w.message) for w in caught if "bytescheduler" in str(w.message)]}


SCENARIOS: Dict[str, tuple] = {
    "accelerate-gpt2": (accelerate_loop, "gpt2", ["ddp", "hook", "optimizer"]),
    "accelerate-bert": (accelerate_loop, "bert", ["ddp", "hook", "optimizer"]),
    "trainer-gpt2": (trainer_run, "gpt2", ["scheduled", "plain"]),
    "trainer-bert": (trainer_run, "bert", ["scheduled", "plain"]),
    "trainer-too-late": (trainer_too_late, "gpt2", ["scheduled"]),
}


def main(scenario: str, out: str) -> None:
    torch.set_num_threads(1)
    transformers.logging.set_verbosity_error()
    run, model_name, systems = SCENARIOS[scenario]
    results = {system: run(system, out, scenario, model_name) for system in systems}
    torch.save(results, os.path.join(out, f"{scenario}.rank{os.environ['RANK']}.pt"))
    if torch.distributed.is_initialized():  # not after Accelerate's end_training
        torch.distributed.barrier()
        torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
