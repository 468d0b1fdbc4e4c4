"""Two workers (no parameter server needed) where one failure causes the other.

    dies_after_peer.py SOCKET_PATH

Worker 1 listens on the Unix socket SOCKET_PATH, accepts worker 0, and dies with exit code 3.
Worker 0 notices the lost connection and, 30 ms later, fails with exit code 1: the job's status
must be worker 1's, although both are gone by the launcher's next look.
"""

import os
import socket
import sys
import time


def main(path: str) -> None:
    if os.environ["BYTESCHEDULER_LAUNCH_INDEX"] == "1":
        server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        server.bind(path)
        server.listen(1)
        peer, _ = server.accept()
        time.sleep(0.2)
        print("CRASHING", flush=True)
        os._exit(3)
    peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    end = time.monotonic() + 30.0
    while True:
        try:
            peer.connect(path)
            break
        except (FileNotFoundError, ConnectionRefusedError):
            if time.monotonic() > end:
                raise
            time.sleep(0.01)
    assert peer.recv(1) == b""  # worker 1 is gone
    time.sleep(0.03)
    print("PEER LOST", flush=True)
    os._exit(1)


if __name__ == "__main__":
    main(sys.argv[1])
