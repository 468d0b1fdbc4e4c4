"""What processes hold, read from ``/proc``: memory, threads, descriptors, sockets, listening ports.

Framework-free (the soak and chaos tools run in the MXNet environment too) and without
psutil, which that environment lacks. Linux only.

>>> sample = resources()
>>> sample.threads >= 1 and sample.fds >= 3 and sample.rss_kib > 0
True
>>> import socket
>>> probe = socket.socket(); probe.bind(("127.0.0.1", 0)); probe.listen()
>>> probe.getsockname()[1] in listening_ports([os.getpid()])
True
>>> probe.close()
"""

from __future__ import annotations

import ctypes
import os
import signal
import tempfile
from dataclasses import asdict, dataclass
from typing import Dict, Iterable, List, Set

# /proc/net/tcp's state column (include/net/tcp_states.h).
TCP_LISTEN = "0A"


@dataclass(frozen=True)
class Resources:
    """One process's holdings at one moment."""

    rss_kib: int  # resident set size (VmRSS)
    threads: int
    fds: int  # open file descriptors
    sockets: int  # those of them that are sockets

    def as_dict(self) -> Dict[str, int]:
        return asdict(self)


def resources(pid: str = "self") -> Resources:
    """RSS, thread count, open descriptors and open sockets of ``pid`` (default: this process)."""
    fields = {}
    with open(f"/proc/{pid}/status") as handle:
        for line in handle:
            name, _, value = line.partition(":")
            if name in ("VmRSS", "Threads"):
                fields[name] = int(value.split()[0])
    fds = sockets = 0
    directory = f"/proc/{pid}/fd"
    for fd in os.listdir(directory):
        try:
            target = os.readlink(f"{directory}/{fd}")
        except OSError:  # closed while being listed (the listing's own descriptor, for one)
            continue
        fds += 1
        sockets += target.startswith("socket:")
    return Resources(rss_kib=fields["VmRSS"], threads=fields["Threads"], fds=fds, sockets=sockets)


class _MallInfo2(ctypes.Structure):
    # glibc's struct mallinfo2 (malloc.h, glibc >= 2.33): size_t fields, summed over every arena.
    _fields_ = [(name, ctypes.c_size_t) for name in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks",
                                                     "fsmblks", "uordblks", "fordblks", "keepcost")]


def allocator() -> Dict[str, int]:
    """What glibc's malloc holds in this process, over all its arenas (KiB), and how many
    arenas it made; empty where there is no glibc ``mallinfo2`` (musl, macOS, glibc < 2.33).

    ``malloc_in_use_kib`` (blocks handed out and not freed, mmapped ones included) grows with
    a leak; ``malloc_free_kib`` (memory the allocator keeps but nobody uses) grows when
    freed memory is not reused or returned: fragmentation, or an allocator still settling.

    >>> stats = allocator()
    >>> not stats or stats["malloc_in_use_kib"] > 0
    True
    """
    try:
        libc = ctypes.CDLL(None)
        call = libc.mallinfo2
    except (OSError, AttributeError):
        return {}
    call.restype = _MallInfo2
    info = call()
    return {"malloc_in_use_kib": (info.uordblks + info.hblkhd) // 1024, "malloc_free_kib": info.fordblks // 1024,
            "malloc_arenas": _arenas(libc)}


def _arenas(libc: ctypes.CDLL) -> int:
    """The number of malloc arenas (``<heap nr=`` entries of ``malloc_info``); -1 if unknown."""
    try:
        with tempfile.TemporaryFile("w+") as handle:
            libc.fdopen.restype = ctypes.c_void_p
            libc.fdopen.argtypes = [ctypes.c_int, ctypes.c_char_p]
            stream = libc.fdopen(os.dup(handle.fileno()), b"w")
            if not stream:
                return -1
            libc.malloc_info.argtypes = [ctypes.c_int, ctypes.c_void_p]
            libc.fclose.argtypes = [ctypes.c_void_p]
            libc.malloc_info(0, stream)
            libc.fclose(stream)
            handle.seek(0)
            return handle.read().count("<heap nr=")
    except (OSError, AttributeError):
        return -1


def socket_inodes(pid: int) -> Set[str]:
    """Inodes of the sockets ``pid`` has open (empty when it is gone or not ours to read)."""
    inodes = set()
    directory = f"/proc/{pid}/fd"
    try:
        names = os.listdir(directory)
    except OSError:
        return inodes
    for fd in names:
        try:
            target = os.readlink(f"{directory}/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    return inodes


def tcp_sockets() -> List[Dict[str, str]]:
    """Every TCP socket of this network namespace (IPv4 and IPv6): local port, state, inode."""
    found = []
    for path in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(path) as handle:
                lines = handle.readlines()[1:]
        except OSError:
            continue
        for line in lines:
            columns = line.split()
            found.append({"port": str(int(columns[1].rsplit(":", 1)[1], 16)), "state": columns[3],
                          "inode": columns[9]})
    return found


def listening_ports(pids: Iterable[int]) -> Set[int]:
    """TCP ports on which any of ``pids`` listens."""
    inodes: Set[str] = set()
    for pid in pids:
        inodes |= socket_inodes(pid)
    return {int(entry["port"]) for entry in tcp_sockets()
            if entry["state"] == TCP_LISTEN and entry["inode"] in inodes}


def still_listening(ports: Iterable[int]) -> Set[int]:
    """Those of ``ports`` on which some socket (anyone's) is listening now."""
    wanted = {str(port) for port in ports}
    return {int(entry["port"]) for entry in tcp_sockets() if entry["state"] == TCP_LISTEN and entry["port"] in wanted}


def alive(pid: int) -> bool:
    """True for a live process (a zombie counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as handle:
            state = handle.read().rsplit(b")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in (b"Z", b"X")


def marked_pids(variable: str, value: str) -> List[int]:
    """Live processes whose environment holds ``variable=value`` (their children inherit it).

    This is how the tools find every process of a job, also those a launcher started in
    sessions of their own, and only those: no other process carries the value.
    """
    needle = f"{variable}={value}".encode()
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as handle:
                if needle in handle.read().split(b"\0"):
                    found.append(int(entry))
        except OSError:
            continue
    return [pid for pid in found if alive(pid)]


def kill_all(pids: Iterable[int], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``pids`` that still exists."""
    for pid in pids:
        try:
            os.kill(pid, sig)
        except (ProcessLookupError, PermissionError):
            pass
