"""The simulator's parameter server uses ScheduledKVStore's own defaults and key layout."""

import mxnet as mx

from bytescheduler.mxnet.keys import SUBKEY_BASE, KeyLayout
from bytescheduler.mxnet.kvstore import KVSTORE_DEFAULTS
from bytescheduler.sim import ps
from bytescheduler.sim.engine import default_config
from bytescheduler.sim.training import Gradient


def test_the_simulated_store_has_the_stores_defaults():
    assert default_config("ps-scheduled") == KVSTORE_DEFAULTS
    assert default_config("mxnet-scheduled") == KVSTORE_DEFAULTS
    assert ps.SUBKEY_BASE == SUBKEY_BASE


def test_the_simulated_layout_is_the_stores():
    grain = 4 * 2**20
    sizes = [1000, 3 * 2**20, 9 * 2**20 + 4, 4 * 2**20, 17 * 2**20]
    layout = KeyLayout(grain)
    infos = layout.register([(key, mx.nd.zeros((size // 4,))) for key, size in enumerate(sizes)])
    simulated = ps.grain_layout([Gradient(key, size, 0.0, key) for key, size in enumerate(sizes)], 2, grain)
    for info in infos:
        keys = simulated[info.key]
        assert [k.key for k in keys] == list(info.subkeys)
        assert [k.nbytes for k in keys] == [(stop - start) * 4 for start, stop in info.grains]
