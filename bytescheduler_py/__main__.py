"""``python -m bytescheduler ...``: the same as the ``bytescheduler`` command."""

from .cli import main

raise SystemExit(main())
