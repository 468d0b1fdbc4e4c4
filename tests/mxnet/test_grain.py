"""The grain rule (bytescheduler/mxnet/grain.py) on its own; the probe itself runs in real
parameter-server jobs (test_kvstore.py)."""

import doctest

import pytest

from bytescheduler.core.config import server_grain_bytes
from bytescheduler.mxnet import grain

CREDIT = 64 * 1024**2


def test_module_examples():
    result = doctest.testmod(grain)
    assert result.attempted > 0 and result.failed == 0


@pytest.mark.parametrize("servers", [1, 2])
def test_a_fast_link_on_few_servers_keeps_keys_whole(servers):
    fast = grain.FAST_LINK_BYTES_PER_S
    assert grain.choose_grain(fast, servers, CREDIT) == grain.COARSE_GRAIN_BYTES
    assert grain.choose_grain(fast * 0.99, servers, CREDIT) == server_grain_bytes(servers, CREDIT) == 4 * 1024**2


@pytest.mark.parametrize("servers", [4, 8, 32])
def test_more_servers_follow_their_number_whatever_the_link(servers):
    for rate in (1e6, grain.FAST_LINK_BYTES_PER_S, 1e12):
        assert grain.choose_grain(rate, servers, CREDIT) == server_grain_bytes(servers, CREDIT) < 4 * 1024**2
