"""ScheduledKVStore's step pacing (mxnet/plain.py): at a step's first push the store waits for
the step before the last one, on the plain path (every worker) and the schedule (rank 0)."""

from types import SimpleNamespace

import mxnet as mx

from bytescheduler.mxnet.keys import KeyInfo
from bytescheduler.mxnet.plain import StoreModes


class Layout:
    def __init__(self, count):
        self.keys = [SimpleNamespace(last=None) for _ in range(count)]

    def infos(self):
        return self.keys


class Inner:
    """An inner store whose pull is an engine write of each output array, as a real pull is."""

    def pull(self, key, out=None, priority=0, ignore_sparse=True):
        for arr in out if isinstance(out, list) else [out]:
            arr[:] = arr + 1


def modes_for(rank, layout, waited):
    return StoreModes(Inner(), rank, 2, layout, scheduler=None, drain=lambda: None, wait_done=waited.append)


def test_rank_0_waits_for_the_schedule_of_the_step_before_the_last():
    layout, waited = Layout(3), []
    modes = modes_for(0, layout, waited)
    for step in range(1, 5):
        for index, info in enumerate(layout.keys):
            info.last = f"job{step}.{index}"  # the step's last operation of each key
        modes._pace()  # step + 1 begins: it waits for step - 1
        assert waited == [f"job{done}.{index}" for done in range(1, step) for index in range(3)], (step, waited)


def test_other_ranks_never_wait_for_the_schedule():
    layout, waited = Layout(2), []
    modes = modes_for(1, layout, waited)
    for step in range(4):
        for info in layout.keys:
            info.last = f"job{step}"
        modes._pace()
    assert waited == []


def test_the_plain_path_marks_each_steps_pulls_and_keeps_one_mark_in_flight():
    info = KeyInfo(0, 0, (4,), "float32", [(0, 4)], [0])
    modes = modes_for(1, Layout(0), [])
    weight = mx.nd.zeros((4,))  # gluon pulls into the same array every step
    for _ in range(5):
        modes._pace()
        modes.calls.pull([info], [[weight]], priority=0, ignore_sparse=True)
    assert len(modes.calls._marks) == 1  # the last step's mark; older ones waited for and let go
    assert list(modes.calls._written.values()) == [weight]  # one array, however many steps
    modes._pace()
    mark = modes.calls._marks[-1][0]
    assert mark.asnumpy().tolist() == [5.0]  # the copy ran behind the fifth step's pull
    modes.calls.drain()
    assert not modes.calls._marks and not modes.calls._written


def test_a_long_hold_of_the_plain_path_runs_unpaced_until_its_timed_steps_near():
    """On a hold of MXNet's own calls the training thread runs ahead as with an unwrapped store;
    the pacing comes back PACE_AHEAD steps before the hold's last ``retrial`` steps, whose times
    the re-trial compares, and stays on the schedule's steps."""
    from bytescheduler.core.modes import PLAIN, ModeChooser, ModeDriver, ModeSwitchParams
    from bytescheduler.mxnet.plain import PACE_AHEAD

    hold, retrial = 30, 8
    modes = modes_for(1, Layout(0), [])
    modes._scheduler = SimpleNamespace(step_boundary=lambda: None)
    modes.driver = ModeDriver(ModeChooser(ModeSwitchParams(hold=hold, min_retrial=retrial), start=PLAIN), leader=False,
                              agree=lambda proposal, veto: proposal)
    modes.plain = True
    paced, plain = [], {}
    modes._pace = lambda: paced.append(modes._steps.steps)  # the step now beginning
    info = KeyInfo(0, 0, (4,), "float32", [(0, 4)], [0])
    for step in range(1, hold + 6):
        plain[step] = modes.begin_step([info])  # the step's first push
    assert [step for step in plain if plain[step]] == list(range(1, hold + 1))  # the hold, then the re-trial
    first_timed = hold - retrial + 1
    assert paced == list(range(first_timed - PACE_AHEAD + 1, hold + 6))
    # At least two paced steps (the catch-up and a settled one) before the first timed step begins.
    assert first_timed - paced[0] >= 2
