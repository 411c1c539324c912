"""The job's gRPC token: `rlfleet run` keeps one per run directory, private to its owner, and hands its workers
the path; reruns reuse it."""

from __future__ import annotations

import stat

import pytest

from conftest import make_job
from rlfleet.workers import local
from rlfleet.workers.auth import MIN_TOKEN_CHARS, TOKEN_FILE_ENV, ensure_token_file, new_token, read_token, sync_key
from rlfleet.workers.sync.group import GroupAddress, open_group


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_token_file_is_private_random_and_kept(tmp_path):
    run, other = tmp_path / "run", tmp_path / "other"
    run.mkdir(), other.mkdir()
    path = ensure_token_file(run)
    assert mode(path) == 0o600
    token = read_token(path)
    assert len(token) >= MIN_TOKEN_CHARS
    assert read_token(ensure_token_file(other)) != token  # one per run
    assert ensure_token_file(run) == path and read_token(path) == token  # a rerun resumes under the same token
    assert [p.name for p in run.iterdir()] == ["token"]  # no temporary file left behind


@pytest.mark.parametrize("text", ["", "\n", "abc"])
def test_a_short_or_empty_token_is_refused(tmp_path, text):
    (tmp_path / "token").write_text(text)
    with pytest.raises(ValueError, match="token"):
        read_token(tmp_path / "token")


def test_rlfleet_run_gives_every_worker_the_run_dirs_token_file(tmp_path, monkeypatch):
    """run_local up to the point where processes would start: each planned worker gets the token's path."""
    spawned = []
    monkeypatch.setattr(local, "spawn", lambda worker, run_dir: spawned.append(worker) or worker)
    monkeypatch.setattr(local, "watch", lambda *args: None)
    monkeypatch.setattr(local, "stop", lambda children: None)
    run_dir = tmp_path / "run"
    assert local.run_local(make_job(), run_dir) == 0
    token_file = run_dir / "token"
    assert mode(token_file) == 0o600
    assert {w.env[TOKEN_FILE_ENV] for w in spawned} == {str(token_file)}
    assert {w.role for w in spawned} == {"generator", "scorer", "trainer"}
    first = read_token(token_file)
    assert local.run_local(make_job(), run_dir) == 0
    assert read_token(token_file) == first


def test_the_sync_key_is_the_tokens_alone_and_never_the_token():
    token = new_token()
    assert sync_key(token) == sync_key(token) != sync_key(new_token())
    assert token not in sync_key(token)
    for short in ("", "x" * (MIN_TOKEN_CHARS - 1)):
        with pytest.raises(ValueError, match="token"):
            sync_key(short)


def test_no_sync_group_without_a_key():
    with pytest.raises(ValueError, match="sync key"):
        open_group(GroupAddress("127.0.0.1", 1, 2, "gloo", 1.0), 0)
