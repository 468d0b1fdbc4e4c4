"""One rank of the Horovod peer-parity table; run under horovodrun by tests/test_peer_parity.py.

    horovodrun -np 2 -H localhost:2 --gloo python tests/parity_horovod_worker.py [--tolerance=T] NAME...

For each scenario of :data:`SCENARIOS` named (all without names) it trains one model with
``hvd.DistributedOptimizer`` alone and one with bytescheduler's ScheduledOptimizer over it,
from the same weights and batches, and prints one line ``RESULT {json}``: the rank and,
per scenario, what differs (:func:`tests.parity.differences`; empty when nothing does):
bit for bit, or within the relative ``--tolerance`` (more than two ranks, where Horovod's
fusion and our pieces sum in different orders).
"""

from __future__ import annotations

import json
import os
import sys
from typing import Dict, List

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import horovod.torch as hvd  # noqa: E402
import torch  # noqa: E402

import bytescheduler.pytorch.horovod as bsc  # noqa: E402
from tests.parity import OPTIMIZERS, Scenario, differences, run_loop, seeded  # noqa: E402

_HOROVOD_SCHEDULED = dict(adaptive=False, partition_bytes=256, credit_bytes=1024)
_HOROVOD_PLAIN = dict(adaptive=True, start_plain=True)

SCENARIOS: List[Scenario] = [
    *[Scenario(f"horovod-{kind}", optimizer=kind, ours=_HOROVOD_SCHEDULED) for kind in OPTIMIZERS],
    Scenario("horovod-unused-one-rank", plan="one-rank", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-unused-all-ranks", plan="all-ranks", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-unused-rank0", plan="rank0", optimizer="adam", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-unused-plain", plan="all-ranks", ours=_HOROVOD_PLAIN),
    Scenario("horovod-unused-accumulated", plan="all-ranks", passes=2, ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-experts", model="experts", optimizer="adamw", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-experts-switching", model="experts", steps=28),  # see experts-switching
    Scenario("horovod-tied-weights", model="tied", optimizer="adam", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-hf-gpt2", model="hf-gpt2", optimizer="adamw", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-hf-bert", model="hf-bert", optimizer="adamw", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-two-dtypes", model="two-dtypes", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-checkpoint", optimizer="adam", checkpoint=True, ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-lr-schedule", schedule=True, ours=_HOROVOD_SCHEDULED),
    # Uneven inputs, each epoch ending in hvd.join(), against hvd.DistributedOptimizer with Horovod's join.
    Scenario("horovod-join-rank0-first", join="first", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-join-last-first", join="last", optimizer="adam", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-join-plain", join="first", ours=_HOROVOD_PLAIN),
    Scenario("horovod-join-switching", join="last", steps=28),
    Scenario("horovod-join-unused", join="first", plan="one-rank", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-join-epochs", join="last", epochs=3, optimizer="adamw", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-join-epochs-plain", join="first", epochs=2, ours=_HOROVOD_PLAIN),
    Scenario("horovod-join-even", join="even", epochs=2, ours=_HOROVOD_SCHEDULED),  # every rank joins at once
]
BY_NAME: Dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def _distributed(model: torch.nn.Module, kind: str, passes: int) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
                                    backward_passes_per_step=passes)


def _epochs(scenario: Scenario, rank: int, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
            synchronize, join) -> tuple:
    """Train the scenario's epochs, each ending in ``join()`` under ``join``; the losses and
    what each join returned."""
    losses, lasts = [], []
    if scenario.join:
        synchronize = lambda: None  # noqa: E731 - the join waits for the last step
    for _ in range(scenario.epochs):
        losses += run_loop(scenario, rank, model, model, optimizer, synchronize, world_size=hvd.size())
        if scenario.join:
            lasts.append(join())
    if scenario.join:  # after a join the gradients are each rank's own: compare the models
        model.zero_grad(set_to_none=True)
    return losses, lasts


def run(scenario: Scenario, tolerance: float = 0.0) -> List[str]:
    rank = hvd.rank()
    print(f"rank {rank}: scenario {scenario.name}", file=sys.stderr, flush=True)
    theirs = seeded(scenario)
    ours = seeded(scenario)
    baseline = _distributed(theirs, scenario.optimizer, scenario.passes)
    horovods_join = hvd.join  # Horovod's own, before a ScheduledOptimizer is open
    optimizer = bsc.ScheduledOptimizer(ours, _distributed(ours, scenario.optimizer, scenario.passes),
                                       timeout=30, **scenario.ours)
    try:
        their_losses, their_lasts = _epochs(scenario, rank, theirs, baseline, lambda: None, horovods_join)
        our_losses, our_lasts = _epochs(scenario, rank, ours, optimizer, optimizer.synchronize, lambda: hvd.join())
        found = differences(ours, theirs, tolerance)
        if tolerance == 0.0 and our_losses != their_losses:
            found.append("losses")
        if scenario.join == "even":  # every rank joins at once: Horovod's last is whichever came last
            if any(last not in range(hvd.size()) for last in our_lasts):
                found.append(f"hvd.join() returned {our_lasts}")
        elif our_lasts != their_lasts:
            found.append(f"hvd.join() returned {our_lasts}, Horovod's {their_lasts}")
        if all(torch.equal(p, q) for p, q in zip(ours.parameters(), seeded(scenario).parameters())):
            found.append("training did not change the parameters")
        return found
    finally:
        optimizer.close()


def main() -> None:
    torch.set_num_threads(1)
    bsc.init()
    args = sys.argv[1:]
    tolerance = float(args.pop(0).split("=", 1)[1]) if args and args[0].startswith("--tolerance=") else 0.0
    names = args or [s.name for s in SCENARIOS]
    table = {name: run(BY_NAME[name], tolerance) for name in names}
    print("RESULT " + json.dumps({"rank": hvd.rank(), "table": table}, sort_keys=True), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
