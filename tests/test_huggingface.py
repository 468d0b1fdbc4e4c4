"""bytescheduler.accelerate and bytescheduler.transformers against Hugging Face's own DDP runs, bit for bit.

Each test starts two real processes (``tests/huggingface_worker.py``) with a launcher's
variables; Accelerate creates the gloo process group. A GPT-2 and a BERT built from their
configs (tied embeddings; BERT's pooler unused) are trained from the same weights and
batches with bytescheduler and with Accelerate's (or the Trainer's) plain DDP; parameters,
buffers and every loss must be equal, and each scheduled run's timeline must have events
on every rank (the scheduler really ran).

Accelerate and transformers are test requirements (``make huggingface``, part of
``make test``, installs them): these tests do not skip.
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

import accelerate  # noqa: F401 - missing, they fail here, loudly, rather than skipping
import transformers  # noqa: F401

from tests.worker_ranks import ROOT, assert_same_run, assert_same_state, assert_timeline_ran, run_worker

DEADLINE = 180.0  # seconds for both ranks of one scenario (each takes 7-12 s on an idle 2-core machine)


def run(scenario: str, out) -> list:
    return run_worker("tests.huggingface_worker", scenario, out, DEADLINE)


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_accelerate_both_adapters_give_accelerates_ddp_numbers(tmp_path, model):
    scenario = f"accelerate-{model}"
    ranks = run(scenario, tmp_path)
    for rank, runs in enumerate(ranks):
        for adapter in ("optimizer", "hook"):
            assert_same_run(runs[adapter], runs["ddp"], f"rank {rank}, {model}, adapter={adapter!r} against DDP")
            assert runs[adapter]["lrs"] == runs["ddp"]["lrs"]
            assert torch.equal(runs[adapter]["evaluation"], runs["ddp"]["evaluation"])
            assert runs[adapter]["warnings"] == [], runs[adapter]["warnings"]  # the LR scheduler follows quietly
        assert runs["optimizer"]["seen"] == {"ddp": False, "scheduled": True}  # no DDP: ScheduledOptimizer
        assert runs["hook"]["seen"] == {"ddp": True, "scheduled": False}
        assert runs["ddp"]["seen"] == {"ddp": True, "scheduled": False}
        assert runs["optimizer"]["step_after_close"] == "closed"  # end_training closed it
        assert len(set(runs["ddp"]["lrs"])) > 3  # the schedule moved
        assert len(runs["ddp"]["loss_tensors"]) == 13  # 4 + 4 + 5 batches
    assert not torch.equal(ranks[0]["ddp"]["loss_tensors"][0], ranks[1]["ddp"]["loss_tensors"][0])  # own batches
    for adapter in ("optimizer", "hook"):
        assert_timeline_ran(tmp_path, f"{scenario}-{adapter}")


@pytest.mark.parametrize("model", ["gpt2", "bert"])
def test_trainer_scheduled_gives_the_trainers_numbers(tmp_path, model):
    scenario = f"trainer-{model}"
    ranks = run(scenario, tmp_path)
    for rank, runs in enumerate(ranks):
        ours, theirs = runs["scheduled"], runs["plain"]
        assert_same_state(ours["first"]["state"], theirs["first"]["state"], f"rank {rank}, {model}, first train()")
        assert_same_state(ours["state"], theirs["state"], f"rank {rank}, {model}, second train()")
        assert ours["losses"] == theirs["losses"] and len(theirs["losses"]) == 15  # 6 steps, then 9
        assert ours["ddp"] and theirs["ddp"]
        assert ours["slots"] == 1 and ours["closed"] is True  # one DDP, its scheduler closed at train end
        assert ours["warnings"] == [] and theirs["warnings"] == []
    assert_timeline_ran(tmp_path, f"{scenario}-scheduled")


def test_trainer_warns_when_its_first_step_ran_without_the_hook(tmp_path):
    for rank, runs in enumerate(run("trainer-too-late", tmp_path)):
        warned = runs["scheduled"]["warnings"]
        assert len(warned) == 1 and "before train()" in warned[0], (rank, warned)


# ------------------------------------------------------------------- in this process


def test_wrong_options_are_refused_naming_the_fix():
    import bytescheduler.accelerate as bsa
    from bytescheduler.transformers import schedule

    accelerator = accelerate.Accelerator(cpu=True)
    model = torch.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="'optimizer'.*'hook'"):
        bsa.prepare(accelerator, model, adapter="ddp")
    with pytest.raises(TypeError, match="partition_bytes"):
        bsa.prepare(accelerator, model, partition_byte="1MiB")
    with pytest.raises(TypeError, match="DistributedDataParallelKwargs"):
        bsa.prepare(accelerator, model, bucket_cap_mb=1)
    with pytest.raises(ValueError, match="partition_bytes"):
        bsa.prepare(accelerator, model, partition_bytes="four megabytes")
    with pytest.raises(TypeError, match="backward_passes_per_step"):
        bsa.prepare(accelerator, model, adapter="hook", backward_passes_per_step=2)
    with pytest.raises(TypeError, match="transformers.Trainer"):
        schedule(accelerator)
    # one process: nothing to schedule, Accelerate's own prepare
    assert bsa.prepare(accelerator, model) is model


def test_importing_the_library_does_not_import_hugging_face():
    code = ("import sys, bytescheduler, bytescheduler.pytorch; "
            "assert not any(m.split('.')[0] in ('accelerate', 'transformers') for m in sys.modules), "
            "sorted(m for m in sys.modules if m.split('.')[0] in ('accelerate', 'transformers'))")
    subprocess.run([sys.executable, "-c", code], check=True, cwd=ROOT, timeout=120)
