"""One logging setup for every process: role and rank in every line, JSON when asked."""

from __future__ import annotations

import json
import logging
import os
import sys


class _JsonFormatter(logging.Formatter):
    def __init__(self, role: str, rank: int):
        super().__init__()
        self.role, self.rank = role, rank

    def format(self, record: logging.LogRecord) -> str:
        entry = {
            "time": self.formatTime(record),
            "level": record.levelname,
            "role": self.role,
            "rank": self.rank,
            "logger": record.name,
            "message": record.getMessage(),
        }
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry)


def setup_logging(role: str, rank: int = 0, json_logs: bool | None = None) -> None:
    """Configure the root logger; RLFLEET_LOG_JSON=1 switches to JSON lines (what Kubernetes wants)."""
    if json_logs is None:
        json_logs = os.environ.get("RLFLEET_LOG_JSON") == "1"
    handler = logging.StreamHandler(sys.stderr)
    if json_logs:
        handler.setFormatter(_JsonFormatter(role, rank))
    else:
        handler.setFormatter(
            logging.Formatter(f"%(asctime)s %(levelname)s {role}-{rank} %(name)s: %(message)s")
        )
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(os.environ.get("RLFLEET_LOG_LEVEL", "INFO"))
