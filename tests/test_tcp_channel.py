"""TcpOrderChannel: rank 0's decisions reach every follower in order over real sockets (127.0.0.1)."""

import socket
import threading
import time

import pytest

from bytescheduler.core.errors import CommunicationError, CommunicationTimeout
from bytescheduler.core.ordering import STOP, decode, encode_ops, encode_stop
from bytescheduler.core.tcp_channel import TcpOrderChannel


def connected(world_size: int, timeout: float = 5.0, token: int = 0):
    leader = TcpOrderChannel(0, timeout)
    port = leader.serve(world_size, token=token)
    followers = [TcpOrderChannel(rank, timeout) for rank in range(1, world_size)]
    threads = [threading.Thread(target=f.join, args=(("127.0.0.1", port), token)) for f in followers]
    for thread in threads:
        thread.start()
    leader.accept()
    for thread in threads:
        thread.join(5)
    return leader, followers


def test_messages_arrive_in_order_at_every_follower():
    leader, followers = connected(3)
    try:
        big = [(0, [(key, 1, 0, 10) for key in range(2000)])]  # 8,000+ words: many TCP segments
        messages = [encode_ops(1, [(1, [(3, 0, 0, 5)])]), encode_ops(1, big), encode_stop(1)]
        for message in messages:
            leader.publish(message)
        cancel = threading.Event()
        for follower in followers:
            got = [follower.receive(cancel) for _ in messages]
            assert got == messages
            assert decode(got[1], 1) == big
            assert decode(got[2], 1) is None
    finally:
        leader.close()
        for follower in followers:
            follower.close()


def test_leader_gone_raises_on_the_follower_and_cancel_returns_none():
    leader, (follower,) = connected(2)
    cancel = threading.Event()
    timer = threading.Timer(0.2, cancel.set)
    timer.start()
    started = time.monotonic()
    assert follower.receive(cancel) is None  # nothing sent: returns once cancelled
    assert time.monotonic() - started < 2.0
    leader.close()
    with pytest.raises(CommunicationError, match="closed the ordering connection"):
        follower.receive(threading.Event())
    follower.close()


def test_follower_gone_raises_on_the_leader():
    leader, (follower,) = connected(2)
    follower.close()
    with pytest.raises(CommunicationError, match="left the ordering channel"):
        for _ in range(200):  # the first sends may still be buffered by the kernel
            leader.publish(list(range(1000)))
            time.sleep(0.005)
    leader.close()


def test_missing_follower_times_out_with_a_clear_error():
    leader = TcpOrderChannel(0, 0.5)
    leader.serve(2)
    with pytest.raises(CommunicationTimeout, match="0 of 1 ranks connected"):
        leader.accept()
    leader.close()
    follower = TcpOrderChannel(1, 0.3)
    with pytest.raises(CommunicationTimeout, match="could not connect to rank 0"):
        follower.join(("127.0.0.1", 9))


def test_a_scheduler_stopped_before_connecting_stops_cleanly():
    leader, follower = TcpOrderChannel(0, 1.0), TcpOrderChannel(1, 1.0)
    epoch = follower.new_epoch()
    leader.publish(encode_stop(epoch))  # nothing listens yet: dropped
    assert follower.receive(threading.Event()) == [epoch, STOP]
    with pytest.raises(CommunicationError, match="not connected"):
        leader.publish(encode_ops(epoch, [(0, [(1, 0, 0, 1)])]))


def test_followers_with_the_token_connect():
    leader, followers = connected(3, token=2**61 + 12345)
    try:
        assert leader.connected and all(f.connected for f in followers)
        leader.publish([7, 8, 9])
        assert [f.receive(threading.Event()) for f in followers] == [[7, 8, 9]] * 2
    finally:
        leader.close()
        for follower in followers:
            follower.close()


def test_a_wrong_token_is_refused_on_both_ends():
    leader = TcpOrderChannel(0, 5.0)
    port = leader.serve(2, token=111)
    follower = TcpOrderChannel(1, 5.0)
    errors = []

    def join():
        try:
            follower.join(("127.0.0.1", port), 222, timeout=5.0)
        except CommunicationError as error:
            errors.append(error)

    thread = threading.Thread(target=join)
    thread.start()
    with pytest.raises(CommunicationError, match="unexpected ordering connection .*token wrong"):
        leader.accept(timeout=5.0)
    thread.join(5)
    assert errors and "did not answer as rank 0's ordering channel" in str(errors[0])
    leader.close()
    follower.close()


def test_another_service_at_the_address_is_not_taken_for_rank_0():
    """A server that accepts but is not an ordering channel (it closes, or answers something else)."""
    for answer in (b"", b"HTTP/1.1"):
        server = socket.create_server(("127.0.0.1", 0))
        port = server.getsockname()[1]

        def serve_once(server=server, answer=answer):
            sock, _ = server.accept()
            sock.recv(64)
            if answer:
                sock.sendall(answer)
            sock.close()

        thread = threading.Thread(target=serve_once)
        thread.start()
        follower = TcpOrderChannel(1, 5.0)
        with pytest.raises(CommunicationError, match="rank 0's ordering channel"):
            follower.join(("127.0.0.1", port), 5, timeout=3.0)
        assert not follower.connected
        thread.join(5)
        server.close()
