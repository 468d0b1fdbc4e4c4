"""ProcessGroups.release closes the TCP order channel; the next claim of the same groups connects a new one."""

from tests.distributed import run_ranks


def _claim_release_twice(rank, world_size):
    import gc
    import warnings

    from bytescheduler.core.tcp_channel import TcpOrderChannel
    from bytescheduler.pytorch.groups import ProcessGroups

    report = []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        for broken in (False, False, True):
            groups = ProcessGroups.claim(None, timeout=30.0)
            channel = groups.order
            assert isinstance(channel, TcpOrderChannel) and channel.connected, channel
            if rank == 0:
                channel.publish([len(report), 7])
            else:
                assert channel.receive(__import__("threading").Event()) == [len(report), 7]
            held = [*channel._followers, channel._leader, channel._listener]
            groups.release(broken=broken)
            report.append((id(groups), all(s is None or s.fileno() == -1 for s in held), groups.order is None))
        del channel, held, groups
        gc.collect()
    unclosed = [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]
    return report, unclosed


def test_release_closes_the_order_channel_and_a_reuse_connects_again():
    for report, unclosed in run_ranks(_claim_release_twice, 2, deadline=120):
        assert unclosed == []
        (first, *_), (second, *_), (third, *_) = report
        assert first == second == third  # the same groups, claimed again
        assert all(closed and cleared for _, closed, cleared in report), report
