"""ScheduledKVStore's grain rule (core/grain.py's choose_grain, which mxnet/grain.py applies
to its link probe at the first init) and the simulator's use of it; the probe itself runs in
real parameter-server jobs (tests/mxnet/test_kvstore.py)."""

import pytest

from bytescheduler.core import grain
from bytescheduler.core.grain import COARSE_GRAIN_BYTES, FAST_LINK_BYTES_PER_S, choose_grain, server_grain_bytes
from bytescheduler_tools.sim.engine import default_config, network_defaults, simulate
from bytescheduler_tools.sim.network import Network
from bytescheduler_tools.sim.profile import Layer, Profile, Tensor

MiB = 1024**2
CREDIT = 64 * MiB


def test_the_rule_is_in_the_grain_modules_examples():
    import doctest

    result = doctest.testmod(grain)
    assert result.failed == 0 and "choose_grain" in " ".join(t.name for t in doctest.DocTestFinder().find(grain))


@pytest.mark.parametrize("servers", [1, 2])
def test_a_fast_link_on_few_servers_keeps_keys_whole(servers):
    assert choose_grain(FAST_LINK_BYTES_PER_S, servers, CREDIT) == COARSE_GRAIN_BYTES
    assert choose_grain(float("inf"), servers, CREDIT) == COARSE_GRAIN_BYTES
    assert choose_grain(FAST_LINK_BYTES_PER_S * 0.99, servers, CREDIT) == server_grain_bytes(servers, CREDIT) == 4 * MiB


@pytest.mark.parametrize("servers", [4, 8, 32])
def test_more_servers_follow_their_number_whatever_the_link(servers):
    for rate in (1e6, FAST_LINK_BYTES_PER_S, float("inf")):
        assert choose_grain(rate, servers, CREDIT) == server_grain_bytes(servers, CREDIT) < 4 * MiB


def test_the_simulator_takes_the_grain_the_store_would_choose():
    # Unset, the simulated store's partition (and so its sub-keys) is what the store's probe
    # would pick on the simulated link; the all-reduce adapters do not depend on the link.
    assert network_defaults("ps-scheduled", Network(125e6), 2).partition_bytes == 4 * MiB
    assert network_defaults("ps-scheduled", Network(1.25e9), 2).partition_bytes == COARSE_GRAIN_BYTES
    assert network_defaults("ps-scheduled", Network(1.25e9, servers=8), 2).partition_bytes == MiB
    assert default_config("ps-scheduled", servers=2) == default_config("ps-scheduled", servers=2, bandwidth=125e6)
    for system in ("scheduled", "ddp-hook", "hvd-scheduled"):
        assert network_defaults(system, Network(1.25e9), 2) == default_config(system)
    # and the simulation runs with it: a 40 MiB layer is one server key at 10 Gbit/s, ten at 1
    profile = Profile("big", (Layer("a", 0.01, (Tensor(40 * MiB, 0.1),)),), backward_s=0.1, step_s=0.0)
    fast = simulate(profile, Network(1.25e9), 2, "ps-scheduled")
    slow = simulate(profile, Network(125e6), 2, "ps-scheduled")
    assert fast.operations < slow.operations, (fast.operations, slow.operations)
