"""One rank of the Horovod peer-parity table; run under horovodrun by tests/test_peer_parity.py.

    horovodrun -np 2 -H localhost:2 --gloo python tests/parity_horovod_worker.py NAME...

For each scenario of :data:`SCENARIOS` named (all without names) it trains one model with
``hvd.DistributedOptimizer`` alone and one with bytescheduler's ScheduledOptimizer over it,
from the same weights and batches, and prints one line ``RESULT {json}``: the rank and,
per scenario, what differs (:func:`tests.parity.differences`; empty when nothing does).
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
    Scenario("horovod-two-dtypes", model="two-dtypes", ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-checkpoint", optimizer="adam", checkpoint=True, ours=_HOROVOD_SCHEDULED),
    Scenario("horovod-lr-schedule", schedule=True, ours=_HOROVOD_SCHEDULED),
]
BY_NAME: Dict[str, Scenario] = {s.name: s for s in SCENARIOS}


def _distributed(model: torch.nn.Module, kind: str, passes: int) -> torch.optim.Optimizer:
    return hvd.DistributedOptimizer(OPTIMIZERS[kind](model.parameters()), named_parameters=model.named_parameters(),
                                    backward_passes_per_step=passes)


def run(scenario: Scenario) -> List[str]:
    rank = hvd.rank()
    print(f"rank {rank}: scenario {scenario.name}", file=sys.stderr, flush=True)
    theirs = seeded(scenario)
    ours = seeded(scenario)
    baseline = _distributed(theirs, scenario.optimizer, scenario.passes)
    optimizer = bsc.ScheduledOptimizer(ours, _distributed(ours, scenario.optimizer, scenario.passes),
                                       timeout=30, **scenario.ours)
    try:
        their_losses = run_loop(scenario, rank, theirs, theirs, baseline, lambda: None)
        our_losses = run_loop(scenario, rank, ours, ours, optimizer, optimizer.synchronize)
        found = differences(ours, theirs)
        if our_losses != their_losses:
            found.append("losses")
        if all(torch.equal(p, q) for p, q in zip(ours.parameters(), seeded(scenario).parameters())):
            found.append("training did not change the parameters")
        return found
    finally:
        optimizer.close()


def main() -> None:
    torch.set_num_threads(1)
    bsc.init()
    names = sys.argv[1:] or [s.name for s in SCENARIOS]
    table = {name: run(BY_NAME[name]) for name in names}
    print("RESULT " + json.dumps({"rank": hvd.rank(), "table": table}, sort_keys=True), flush=True)
    hvd.shutdown()


if __name__ == "__main__":
    main()
