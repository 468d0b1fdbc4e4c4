"""Collection rules shared by every test run.

``tests/mxnet`` needs MXNet 1.9.1, which needs numpy < 1.24, so it runs in its own environment
(``make mxnet`` builds ``.venv-mxnet``; ``make test`` runs ``tests/mxnet`` there). The main
environment has no MXNet, and there that folder is left out of collection. Where MXNet is
installed the folder is always collected, and ``tests/mxnet/conftest.py`` stops the run with
an error if MXNet is installed but cannot be imported: an MXNet test never skips silently.

``tests/docker`` builds on Docker images (``make docker-test`` builds them, starting a daemon if
none runs, and sets BYTESCHEDULER_DOCKER_TESTS=1); other runs leave that folder out. CI runs both.
"""

import importlib.util
import os

collect_ignore = []
if importlib.util.find_spec("mxnet") is None:
    collect_ignore.append("mxnet")
if os.environ.get("BYTESCHEDULER_DOCKER_TESTS") != "1":
    collect_ignore.append("docker")
