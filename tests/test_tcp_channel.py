"""TcpOrderChannel: rank 0's decisions reach every follower in order over real sockets (127.0.0.1)."""

import gc
import os
import socket
import struct
import threading
import time
import warnings

import pytest

from bytescheduler.core import tcp_channel
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


def test_a_wrong_token_is_refused_on_its_own_end_and_the_ranks_still_connect():
    leader = TcpOrderChannel(0, 5.0)
    port = leader.serve(2, token=111)
    accepting = threading.Thread(target=leader.accept)
    accepting.start()
    stranger = TcpOrderChannel(1, 5.0)
    started = time.monotonic()
    with pytest.raises(CommunicationError, match="did not answer as rank 0's ordering channel"):
        stranger.join(("127.0.0.1", port), 222, timeout=5.0)
    assert time.monotonic() - started < 2.0 and not stranger.connected  # refused at once
    follower = TcpOrderChannel(1, 5.0)
    try:
        follower.join(("127.0.0.1", port), 111)
        accepting.join(5)  # the wrong token did not end the wait
        assert leader.connected
        leader.publish([4, 5])
        assert follower.receive(threading.Event()) == [4, 5]
    finally:
        leader.close()
        follower.close()
        stranger.close()


def _strangers(port: int):
    """Connections to rank 0's port that are not ranks: silent, garbage, a rank out of range."""
    silent = socket.create_connection(("127.0.0.1", port))
    garbage = socket.create_connection(("127.0.0.1", port))
    garbage.sendall(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    out_of_range = socket.create_connection(("127.0.0.1", port))
    out_of_range.sendall(struct.pack("<qq", 7, 5))  # the right token, but no rank 7 in a world of 3
    short = socket.create_connection(("127.0.0.1", port))
    short.sendall(b"\x01\x02")
    short.close()  # a few bytes, then gone
    return [silent, garbage, out_of_range]


def test_stray_connections_are_dropped_and_the_ranks_still_connect(monkeypatch):
    monkeypatch.setattr(tcp_channel, "HANDSHAKE_SECONDS", 1.0)
    leader = TcpOrderChannel(0, 10.0)
    port = leader.serve(3, token=5)
    strangers = _strangers(port)
    wrong_token = TcpOrderChannel(1, 5.0)
    errors = []

    def join_wrong():
        try:
            wrong_token.join(("127.0.0.1", port), 6, timeout=5.0)
        except CommunicationError as error:
            errors.append(error)

    impostor = threading.Thread(target=join_wrong)
    impostor.start()
    time.sleep(0.2)  # the strangers come first
    followers = [TcpOrderChannel(rank, 10.0) for rank in (1, 2)]
    threads = [threading.Thread(target=f.join, args=(("127.0.0.1", port), 5)) for f in followers]
    for thread in threads:
        thread.start()
    started = time.monotonic()
    try:
        leader.accept()
        # The silent stranger held nothing up: accept waited for the ranks only.
        assert time.monotonic() - started < tcp_channel.HANDSHAKE_SECONDS
        for thread in threads + [impostor]:
            thread.join(5)
        assert errors and "did not answer as rank 0's ordering channel" in str(errors[0])
        leader.publish([1, 2, 3])
        assert [f.receive(threading.Event()) for f in followers] == [[1, 2, 3]] * 2
        for stranger in strangers:  # each was closed by rank 0, the silent one after the handshake deadline
            stranger.settimeout(tcp_channel.HANDSHAKE_SECONDS + 2.0)
            try:
                assert stranger.recv(8) == b""
            except ConnectionResetError:
                pass
    finally:
        leader.close()
        for channel in followers + [wrong_token]:
            channel.close()
        for stranger in strangers:
            stranger.close()


def test_a_silent_connection_does_not_hold_accept_past_the_handshake_deadline(monkeypatch):
    """Alone at the port, a silent connection is dropped after the handshake deadline."""
    monkeypatch.setattr(tcp_channel, "HANDSHAKE_SECONDS", 0.5)
    leader = TcpOrderChannel(0, 10.0)
    port = leader.serve(2)
    silent = socket.create_connection(("127.0.0.1", port))
    accepting = threading.Thread(target=leader.accept)
    accepting.start()
    silent.settimeout(5.0)
    started = time.monotonic()
    try:
        assert silent.recv(8) == b""
        assert time.monotonic() - started < 0.5 + 1.0
        follower = TcpOrderChannel(1, 5.0)
        follower.join(("127.0.0.1", port))
        accepting.join(5)
        assert leader.connected and not accepting.is_alive()
        follower.close()
    finally:
        leader.close()
        silent.close()


def test_close_ends_accept_at_once_and_closes_a_connection_in_its_handshake():
    leader = TcpOrderChannel(0, 30.0)
    port = leader.serve(2)
    silent = socket.create_connection(("127.0.0.1", port))
    errors = []

    def accept():
        try:
            leader.accept()
        except CommunicationError as error:
            errors.append(error)

    accepting = threading.Thread(target=accept)
    accepting.start()
    time.sleep(0.3)  # the silent connection is in its handshake
    leader.close()
    accepting.join(2)
    try:
        assert not accepting.is_alive(), "close() did not end accept()"
        assert errors and "closed while waiting" in str(errors[0])
        silent.settimeout(2.0)
        assert silent.recv(8) == b""
    finally:
        silent.close()


def _open_sockets() -> int:
    return sum(os.readlink(f"/proc/self/fd/{fd}").startswith("socket:") for fd in os.listdir("/proc/self/fd")
               if os.path.exists(f"/proc/self/fd/{fd}"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts this process's sockets in /proc")
def test_close_leaves_no_socket_open():
    """Leader, followers, strangers, a refused follower: after close() every socket is closed."""
    gc.collect()
    before = _open_sockets()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ResourceWarning)
        leader = TcpOrderChannel(0, 5.0)
        port = leader.serve(3, token=9)
        accepting = threading.Thread(target=leader.accept)
        accepting.start()
        strangers = _strangers(port)
        refused = TcpOrderChannel(1, 5.0)
        with pytest.raises(CommunicationError):
            refused.join(("127.0.0.1", port), 8, timeout=5.0)
        followers = [TcpOrderChannel(rank, 5.0) for rank in (1, 2)]
        for follower in followers:
            follower.join(("127.0.0.1", port), 9)
        accepting.join(5)
        held = [leader._listener, *leader._followers] + [f._leader for f in followers]
        leader.publish([1])
        for channel in [leader, refused] + followers:
            channel.close()
        for stranger in strangers:
            stranger.close()
        assert all(sock is None or sock.fileno() == -1 for sock in held)
        del leader, followers, refused, strangers, held
        gc.collect()
    assert [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)] == []
    assert _open_sockets() == before


def test_the_listener_is_on_the_address_the_followers_are_given(monkeypatch):
    leader = TcpOrderChannel(0, 5.0)
    leader.serve(2, host="127.0.0.1")
    assert leader._listener.getsockname()[0] == "127.0.0.1"
    leader.close()
    # connect() listens on the address it shares: 127.0.0.1 for a rendezvous on this host.
    served = []
    serve = TcpOrderChannel.serve

    def recording_serve(self, *args, **kwargs):
        port = serve(self, *args, **kwargs)
        served.append(self._listener.getsockname()[0])
        return port

    monkeypatch.setattr(TcpOrderChannel, "serve", recording_serve)
    channels = _connect_ranks(2, peer_host="127.0.0.1")
    try:
        assert all(isinstance(c, TcpOrderChannel) for c in channels)
        assert served == ["127.0.0.1"]
    finally:
        for channel in channels:
            channel.close()


def _connect_ranks(world_size: int, peer_host: str):
    """:func:`connect` on ``world_size`` threads, with share and gather over a barrier."""
    barrier = threading.Barrier(world_size)
    boxes = {}

    def share(offer):
        if offer is not None:
            boxes["offer"] = offer
        barrier.wait(10)
        return boxes["offer"]

    def gather(flag):
        boxes[threading.get_ident()] = flag
        barrier.wait(10)
        flags = [v for k, v in boxes.items() if k != "offer"]
        barrier.wait(10)
        return flags

    channels = [None] * world_size

    def rank_main(rank):
        channels[rank] = tcp_channel.connect(rank, world_size, share, gather, peer_host, 5.0, connect_seconds=5.0)

    threads = [threading.Thread(target=rank_main, args=(rank,)) for rank in range(world_size)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(15)
    return channels


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
