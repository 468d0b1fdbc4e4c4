"""An order channel over plain TCP, for backends that have no broadcast of their own.

A parameter server offers push and pull but no way for one worker to tell the others
something. Rank 0 listens on a TCP port; every other rank connects to it once, and rank 0
sends each message (a list of int64, see :mod:`bytescheduler.core.ordering`) to every
follower as ``[count: int64][count x int64]``, little-endian. How the followers learn rank
0's address is up to the adapter (``ScheduledKVStore`` passes it through the store itself,
the torch.distributed and Horovod backends through :func:`connect` over their own collectives).
A follower opens with its rank and a
token rank 0 chose; rank 0 answers with the token, so a follower given a wrong address
never mistakes another service for rank 0. Rank 0 drops any connection that does not
complete this handshake within :data:`HANDSHAKE_SECONDS` (a port scanner, a health check,
a rank of another job) and goes on waiting for the ranks.

>>> leader = TcpOrderChannel(rank=0, timeout=5.0)
>>> leader.serve(world_size=1), leader.is_leader, leader.connected
(0, True, True)
>>> leader.close()
"""

from __future__ import annotations

import logging
import os
import random
import select
import socket
import struct
import threading
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .errors import CommunicationError, CommunicationTimeout
from .log import logger
from .ordering import STOP, encode_stop

_COUNT = struct.Struct("<q")
_HELLO = struct.Struct("<qq")  # a follower's rank and the token

# Seconds a connection to rank 0's listener has to send its handshake before it is dropped.
HANDSHAKE_SECONDS = 2.0


def local_address(peer_host: Optional[str] = None) -> str:
    """This host's IPv4 address as the other ranks see it.

    ``DMLC_NODE_HOST`` when set (ps-lite's own override); otherwise the source address of
    the route to ``peer_host`` (e.g. the parameter server's scheduler), found without
    sending anything; 127.0.0.1 when there is no peer to route to.
    """
    host = os.environ.get("DMLC_NODE_HOST")
    if host:
        return socket.gethostbyname(host)
    if not peer_host:
        return "127.0.0.1"
    probe = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        probe.connect((socket.gethostbyname(peer_host), 9))  # UDP: no packet is sent
        return probe.getsockname()[0]
    finally:
        probe.close()


def _read_exact(sock: socket.socket, size: int, cancel: Optional[threading.Event]) -> Optional[bytes]:
    """Read ``size`` bytes; None as soon as ``cancel`` is set."""
    chunks, got = [], 0
    while got < size:
        if cancel is not None:
            ready, _, _ = select.select([sock], [], [], 0.1)
            if cancel.is_set():
                return None
            if not ready:
                continue
        chunk = sock.recv(size - got)
        if not chunk:
            raise CommunicationError("rank 0 closed the ordering connection; has it died or stopped training?")
        chunks.append(chunk)
        got += len(chunk)
    return b"".join(chunks)


class TcpOrderChannel:
    """:class:`~bytescheduler.core.ordering.OrderChannel` over TCP from rank 0 to the others.

    Create every rank's end with ``TcpOrderChannel(rank, timeout)`` (it can be handed to a
    scheduler at once); rank 0 then calls :meth:`serve` and :meth:`accept`, the others
    :meth:`join` with rank 0's address, before anything is scheduled.
    """

    def __init__(self, rank: int, timeout: float) -> None:
        self.rank = rank
        self.timeout = timeout
        self._listener: Optional[socket.socket] = None
        self._followers: List[socket.socket] = []
        self._leader: Optional[socket.socket] = None
        self._expected = 0
        self._token = 0
        self._epochs = 0
        self._closed = False
        self._lock = threading.Lock()  # the sockets held, against a close() from another thread
        self.connected = False

    # ------------------------------------------------------------------ set-up

    def serve(self, world_size: int, host: str = "127.0.0.1", token: int = 0) -> int:
        """Rank 0: start listening on ``host`` for the other ``world_size - 1`` ranks; return the port.

        ``host`` is the address the followers connect to (every interface when it is not
        one of this host's). Followers must :meth:`join` with the same ``token``.
        """
        self._expected = world_size - 1
        self._token = token
        if self._expected > 0:
            backlog = max(8, world_size)
            try:
                listener = socket.create_server((host, 0), backlog=backlog)
            except OSError as error:
                logger.warning("rank 0: cannot listen for the ordering channel on %s (%s); listening on every "
                               "interface", host, error)
                listener = socket.create_server(("0.0.0.0", 0), backlog=backlog)
            listener.setblocking(False)
            with self._lock:
                if self._closed:
                    listener.close()
                    raise CommunicationError("rank 0: the ordering channel was closed")
                self._listener = listener
        else:
            self.connected = True
        return self.port

    @property
    def port(self) -> int:
        listener = self._listener
        return listener.getsockname()[1] if listener is not None else 0

    def accept(self, timeout: Optional[float] = None) -> None:
        """Wait until every other rank connected (rank 0); ``timeout`` defaults to the channel's.

        Connections that do not complete the handshake (:data:`HANDSHAKE_SECONDS`) are
        dropped and logged; the wait goes on for the ranks.
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        pending: Dict[socket.socket, Tuple[float, bytearray, Any]] = {}  # until, bytes so far, address
        seen: Set[int] = set()
        try:
            while len(self._followers) < self._expected:
                now = time.monotonic()
                if now >= deadline:
                    raise CommunicationTimeout(
                        f"rank 0: {len(self._followers)} of {self._expected} ranks connected to the ordering "
                        f"channel within {limit} s; is every worker running?")
                listener = self._listener
                if listener is None:
                    raise CommunicationError("rank 0: the ordering channel was closed while waiting for the ranks")
                for sock, (until, _, address) in list(pending.items()):
                    if now >= until:
                        _drop(pending, sock, address, f"sent no handshake within {HANDSHAKE_SECONDS} s")
                wake = min([deadline] + [until for until, _, _ in pending.values()])
                # Short waits: closing the listener from another thread does not wake select().
                try:
                    readable, _, _ = select.select([listener, *pending], [], [], min(max(0.0, wake - now), 0.2))
                except (OSError, ValueError):  # the listener was closed meanwhile
                    continue
                for sock in readable:
                    if sock is listener:
                        self._take(listener, pending)
                    else:
                        self._handshake(sock, pending, seen)
            with self._lock:
                listener, self._listener = self._listener, None
            if listener is not None:
                listener.close()
            self.connected = True
        finally:
            for sock in pending:
                sock.close()

    def _take(self, listener: socket.socket, pending: Dict[socket.socket, Tuple[float, bytearray, Any]]) -> None:
        """Accept a waiting connection, if any, into ``pending`` (rank 0)."""
        try:
            sock, address = listener.accept()
        except OSError:  # gone before it was accepted, or the listener was closed
            return
        sock.settimeout(HANDSHAKE_SECONDS)
        pending[sock] = (time.monotonic() + HANDSHAKE_SECONDS, bytearray(), address)

    def _handshake(self, sock: socket.socket, pending: Dict[socket.socket, Tuple[float, bytearray, Any]],
                   seen: Set[int]) -> None:
        """Read what ``sock`` sent; once it has sent a whole handshake, make it a follower or drop it."""
        _, data, address = pending[sock]
        try:
            chunk = sock.recv(_HELLO.size - len(data))
        except OSError as error:
            _drop(pending, sock, address, f"failed ({error})")
            return
        if not chunk:
            _drop(pending, sock, address, "closed before its handshake")
            return
        data += chunk
        if len(data) < _HELLO.size:
            return
        rank, token = _HELLO.unpack(data)
        if token != self._token:
            _drop(pending, sock, address, "sent a wrong token (another job, or not a rank)", logging.WARNING)
        elif not 0 < rank <= self._expected:
            _drop(pending, sock, address, f"sent rank {rank}, not one of 1..{self._expected}", logging.WARNING)
        elif rank in seen:
            _drop(pending, sock, address, f"sent rank {rank}, which is already connected", logging.WARNING)
        else:
            del pending[sock]
            try:
                sock.sendall(_COUNT.pack(self._token))
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.settimeout(self.timeout)
            except OSError as error:
                sock.close()
                logger.debug("rank 0: rank %d left the ordering channel during its handshake (%s)", rank, error)
                return
            with self._lock:
                if self._closed:
                    sock.close()
                    raise CommunicationError("rank 0: the ordering channel was closed while waiting for the ranks")
                self._followers.append(sock)
            seen.add(rank)

    def join(self, address: Tuple[str, int], token: int = 0, timeout: Optional[float] = None) -> None:
        """A follower: connect to rank 0 at ``address``, retrying until ``timeout`` (default: the channel's).

        Raises :class:`CommunicationError` when whatever answers there is not rank 0 (no
        answer with ``token``).
        """
        limit = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + limit
        while True:
            try:
                sock = socket.create_connection(address, timeout=max(0.1, deadline - time.monotonic()))
                break
            except OSError as error:
                if time.monotonic() > deadline:
                    raise CommunicationTimeout(
                        f"rank {self.rank}: could not connect to rank 0's ordering channel at {address[0]}:"
                        f"{address[1]} within {limit} s ({error})") from None
                time.sleep(0.05)
        try:
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.sendall(_HELLO.pack(self.rank, token))
                sock.settimeout(max(0.1, deadline - time.monotonic()))
                answer = _COUNT.unpack(_read_exact(sock, _COUNT.size, None))[0]
            except (OSError, CommunicationError) as error:
                raise CommunicationError(
                    f"rank {self.rank}: {address[0]}:{address[1]} did not answer as rank 0's ordering channel "
                    f"({error})") from None
            if answer != token:
                raise CommunicationError(
                    f"rank {self.rank}: {address[0]}:{address[1]} is not rank 0's ordering channel")
            sock.settimeout(None)
            with self._lock:
                if self._closed:
                    raise CommunicationError(f"rank {self.rank}: the ordering channel was closed")
                self._leader = sock
        except BaseException:
            sock.close()
            raise
        self.connected = True

    # ------------------------------------------------------------------ channel

    @property
    def is_leader(self) -> bool:
        return self.rank == 0

    def new_epoch(self) -> int:
        self._epochs += 1
        return self._epochs

    def publish(self, message: Sequence[int]) -> None:
        if not self.connected:
            if len(message) == 2 and message[1] == STOP:
                return  # stopped before anything was scheduled: nobody listens yet
            raise CommunicationError("rank 0: the ordering channel is not connected yet")
        data = _COUNT.pack(len(message)) + struct.pack(f"<{len(message)}q", *message)
        for sock in self._followers:
            try:
                sock.sendall(data)
            except OSError as error:
                raise CommunicationError(f"rank 0: a rank left the ordering channel ({error})") from error

    def receive(self, cancel: threading.Event) -> Optional[List[int]]:
        if not self.connected:  # stopped before anything was scheduled (rank 0 sends nothing)
            return encode_stop(self._epochs)
        leader = self._leader
        if leader is None:
            raise CommunicationError(f"rank {self.rank}: the ordering channel was closed")
        head = _read_exact(leader, _COUNT.size, cancel)
        if head is None:
            return None
        count = _COUNT.unpack(head)[0]
        body = _read_exact(leader, 8 * count, cancel)
        if body is None:
            return None
        return list(struct.unpack(f"<{count}q", body))

    def close(self) -> None:
        """Close every socket the channel holds; a connection made after this is closed at once."""
        with self._lock:
            self._closed = True
            held = self._followers + [s for s in (self._leader, self._listener) if s is not None]
            self._followers, self._leader, self._listener = [], None, None
        for sock in held:
            try:
                sock.close()
            except OSError:
                pass


def _drop(pending: Dict[socket.socket, Tuple[float, bytearray, Any]], sock: socket.socket, address: Any,
          why: str, level: int = logging.DEBUG) -> None:
    """Close a connection to rank 0's listener that is not one of the ranks, and log it."""
    del pending[sock]
    sock.close()
    logger.log(level, "rank 0: ignored an ordering connection from %s: it %s", address, why)


# Seconds the ranks try to set up the TCP order connection before falling back.
CONNECT_SECONDS = 20.0


def connect(rank: int, world_size: int, share: Callable[[Any], Any], gather: Callable[[Any], List[Any]],
            peer_host: Optional[str], timeout: float,
            connect_seconds: float = CONNECT_SECONDS) -> Optional[TcpOrderChannel]:
    """Connect every rank to rank 0 by TCP; collective. None on every rank if any rank failed.

    The framework's own collectives carry the set-up: ``share(obj)`` returns rank 0's
    ``obj`` on every rank (a broadcast), ``gather(obj)`` every rank's (an all-gather).
    Rank 0 listens on the address of its route towards ``peer_host`` (a host every rank
    reached, e.g. the rendezvous; 127.0.0.1 for a rendezvous on this host) and shares it
    with a random token; the others connect, and all learn together whether everyone did,
    so every rank uses the same channel (the caller's fallback when this returns None).
    """
    channel = TcpOrderChannel(rank, timeout)
    failures: List[BaseException] = []
    accepting = None
    offer = None
    if rank == 0:
        token = random.SystemRandom().getrandbits(62)
        try:
            host = local_address(peer_host)
        except OSError:  # e.g. an unresolvable name: the others then fail to connect, and all fall back
            host = "127.0.0.1"
        port = channel.serve(world_size, host=host, token=token)
        offer = (host, port, token)

        def accept() -> None:
            try:
                channel.accept(timeout=connect_seconds)
            except (OSError, CommunicationError) as error:
                failures.append(error)

        accepting = threading.Thread(target=accept, name="bytescheduler-order-accept", daemon=True)
        accepting.start()
    host, port, token = share(offer)
    if rank != 0:
        try:
            channel.join((host, port), token, timeout=connect_seconds)
        except (OSError, CommunicationError) as error:
            failures.append(error)
    connected = gather(not failures)
    if accepting is not None:
        if not all(connected):
            channel.close()  # ends the accept at once
        accepting.join()
    # Every follower that connected was accepted, so rank 0's accept ends when they all did.
    if all(connected):
        return channel
    if failures:
        logger.warning("rank %d: ordering connection to rank 0 at %s:%d failed (%s); falling back",
                       rank, host, port, failures[0])
    channel.close()
    return None
