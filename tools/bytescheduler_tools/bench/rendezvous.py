"""Horovod's rendezvous server for the benchmark's Horovod job, in a process of its own.

horovodrun runs this server in its own process and cannot place ranks in network
namespaces, so the runner starts this module inside rank 0's namespace (where the ranks
can reach it) and the ranks with the ``HOROVOD_*`` variables horovodrun would set. The
server picks a free port and writes it to ``--port-file`` (atomically); it serves until
it is killed.

    python -m bytescheduler_tools.bench.rendezvous --hosts h0:1,h1:1 --port-file /tmp/port
"""

from __future__ import annotations

import argparse
import os
import time
from typing import List, Optional


def host_plan(hosts: str, size: int) -> list:
    """Horovod's slot assignment (rank, local and cross ranks) for ``hosts`` such as ``"h0:1,h1:1"``."""
    from horovod.runner.common.util.hosts import get_host_assignments, parse_hosts

    return get_host_assignments(parse_hosts(hosts), size)


def main(argv: Optional[List[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hosts", required=True, help="host:slots,... as for horovodrun -H")
    parser.add_argument("--size", type=int, default=2, help="number of ranks")
    parser.add_argument("--port-file", required=True)
    args = parser.parse_args(argv)

    from horovod.runner.http.http_server import RendezvousServer

    server = RendezvousServer(False)
    port = server.start()
    server.init(host_plan(args.hosts, args.size))
    with open(args.port_file + ".tmp", "w") as handle:
        handle.write(str(port))
    os.replace(args.port_file + ".tmp", args.port_file)
    print(f"rendezvous server on port {port}", flush=True)
    while True:
        time.sleep(3600)


if __name__ == "__main__":
    raise SystemExit(main())
