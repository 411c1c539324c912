"""The job's gRPC token: made, stored and read here; `wire` sends and checks it.

One random token per job, read once by every worker from the file RLFLEET_TOKEN_FILE names: `rlfleet run`
writes it into the run directory (mode 0600), the operator mounts the job's Secret. Every worker RPC must
carry `authorization: Bearer <token>`, health checks excepted; the weight-sync stores key everything under
`sync_key(token)`. No grpc import: the planner uses this.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import secrets
import tempfile
from pathlib import Path

TOKEN_FILE_ENV = "RLFLEET_TOKEN_FILE"
RUN_DIR_TOKEN = "token"
"""Name of the token file in a local run directory."""
# token_urlsafe(32) gives 43 characters; anything much shorter was not made by us.
MIN_TOKEN_CHARS = 32


def new_token() -> str:
    return secrets.token_urlsafe(32)


def ensure_token_file(run_dir: Path) -> Path:
    """run_dir's token file: kept if there (a rerun resumes, and its workers must agree), else a new one.

    Written under a temporary name with mode 0600 and renamed, so no reader ever sees half a token.
    """
    path = Path(run_dir) / RUN_DIR_TOKEN
    if not path.exists():
        handle, temporary = tempfile.mkstemp(dir=run_dir, prefix=".token-")  # mkstemp creates it 0600
        with os.fdopen(handle, "w", encoding="ascii") as out:
            out.write(new_token() + "\n")
        os.replace(temporary, path)
    return path


def read_token(path: str | Path) -> str:
    token = Path(path).read_text(encoding="ascii").strip()
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"{path}: a gRPC token of at least {MIN_TOKEN_CHARS} characters is needed")
    return token


def sync_key(token: str) -> str:
    """The prefix of every rendezvous key in a TCPStore (weight-sync groups, the trainers' and the critic's worlds),
    which checks nobody: without the token a peer cannot name a group's keys, so cannot join it; a one-way function
    of the token, so the store never holds the token."""
    if len(token) < MIN_TOKEN_CHARS:
        raise ValueError(f"weight sync needs the job's token (at least {MIN_TOKEN_CHARS} characters)")
    return hmac.new(token.encode("ascii"), b"rlfleet weight sync", hashlib.sha256).hexdigest()
