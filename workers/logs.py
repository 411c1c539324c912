"""One logging setup for every process: role and rank in every line, JSON when asked."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import shutil
import sys
import tempfile
from typing import Iterator, TextIO


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


@contextlib.contextmanager
def output_held_back() -> Iterator[TextIO]:
    """Send this process's stdout and stderr to a temporary file, file descriptors 1 and 2 themselves, so that what
    its children and C++ code print goes there too (vLLM's and transformers' loader logs, progress bars, torch's
    warnings); yields a stream on the real stdout for the result. They stay held back to the end of the process
    (vLLM logs its shutdown at exit). On an exception they come back first, the held-back output written to stderr,
    so a failure is explained."""
    sys.stdout.flush()
    sys.stderr.flush()
    real_out, real_err = os.dup(1), os.dup(2)
    held = tempfile.TemporaryFile()
    os.dup2(held.fileno(), 1)
    os.dup2(held.fileno(), 2)
    try:
        with os.fdopen(os.dup(real_out), "w") as result:
            yield result
    except BaseException:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(real_out, 1)
        os.dup2(real_err, 2)
        held.seek(0)
        shutil.copyfileobj(held, sys.stderr.buffer)
        sys.stderr.flush()
        raise
