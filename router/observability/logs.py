"""How every `router` command logs: one line per record, with time, level and logger.

httpx logs each request at INFO (every health check, etcd call and metrics reading):
those are traffic, not decisions, so its logger stays at WARNING or above whatever the
command's level.
"""

from __future__ import annotations

import logging

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s %(message)s"


def configure_logging(level: str | int) -> None:
    """Log to stderr at `level` (a name such as "info", or a logging constant)."""
    logging.basicConfig(level=level.upper() if isinstance(level, str) else level, format=LOG_FORMAT)
    logging.getLogger("httpx").setLevel(max(logging.WARNING, logging.getLogger().level))
