"""Debug logging: the ``bytescheduler`` logger, to stderr, with the rank in every line."""

from __future__ import annotations

import logging
import sys
from typing import Optional

logger = logging.getLogger("bytescheduler")

_handler: Optional[logging.Handler] = None


def configure_logging(level: Optional[int], rank: int) -> None:
    """Send the library's log records at ``level`` and above to stderr, prefixed by the rank.

    Each process logs to its own stderr; nothing is written to a shared file. Calling it
    again replaces the previous setting; ``level=None`` leaves logging as the user set it.
    """
    global _handler
    if level is None:
        return
    if _handler is not None:
        logger.removeHandler(_handler)
    _handler = logging.StreamHandler(sys.stderr)
    _handler.setFormatter(
        logging.Formatter(f"[bytescheduler rank {rank}] %(asctime)s %(levelname)s %(message)s")
    )
    logger.addHandler(_handler)
    logger.setLevel(level)
    logger.propagate = False
