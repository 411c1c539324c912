"""The python tool's sandbox: ordinary code runs; hostile code (fork bombs, loops, memory, network, files, the
worker's environment, daemons) is refused or killed, with namespaces and in the rlimits-only fallback."""

from __future__ import annotations

import os
import signal
import socket
import tempfile
import uuid
from pathlib import Path

import pytest

from rlfleet.workers.environment import sandbox
from rlfleet.workers.environment.config import Sandbox
from rlfleet.workers.environment.sandbox import BACKEND_VARIABLE, OUTPUT_CHARS, backend, run_code, run_python

pytestmark = pytest.mark.integration  # each run starts a process

LIMITS = Sandbox(timeout_seconds=2.0, memory_mib=256, processes=16)
REPOSITORY = Path(__file__).resolve().parents[2]


@pytest.fixture(params=["unshare", "rlimits"])
def any_backend(request, monkeypatch) -> str:
    monkeypatch.setenv(BACKEND_VARIABLE, request.param)
    return request.param


@pytest.fixture
def namespaces(monkeypatch) -> None:
    monkeypatch.setenv(BACKEND_VARIABLE, "unshare")


def test_ordinary_code_runs_and_imports_the_standard_library(any_backend):
    result = run_python("import math, itertools, fractions, sys\nprint(math.factorial(20), sys.stdin.read())",
                        LIMITS, stdin="in")
    assert (result.reason, result.exit_code, result.stdout) == ("ok", 0, "2432902008176640000 in\n")


def test_a_nonzero_exit_is_reported(any_backend):
    result = run_python("print('before'); raise SystemExit(3)", LIMITS)
    assert (result.reason, result.exit_code, result.stdout) == ("exit", 3, "before\n")


def test_output_is_bounded(any_backend):
    result = run_python(f"print('x' * {OUTPUT_CHARS * 3}); import sys; sys.stderr.write('e' * {OUTPUT_CHARS * 3})",
                        LIMITS)
    assert result.stdout == "x" * OUTPUT_CHARS + "\n[truncated]"
    assert result.stderr == "[truncated]\n" + "e" * OUTPUT_CHARS


def test_an_infinite_loop_times_out_and_its_children_with_it(any_backend):
    marker = f"loop-{uuid.uuid4().hex}"
    result = run_python(f"import os  # {marker}\nos.fork()\nwhile True: pass",
                        LIMITS.model_copy(update={"timeout_seconds": 0.5}))
    assert (kill_left_behind(marker), result.reason, result.exit_code) == ([], "timeout", None)


def test_a_memory_bomb_runs_out_of_memory(any_backend):
    # 1 GiB at most, so that a runner without the limit fails this test instead of the machine.
    result = run_python("blocks = [bytearray(2**24) for _ in range(64)]\nprint('allocated')", LIMITS)
    assert result.reason == "memory" and result.stdout == "", result.stderr


def test_the_workers_environment_is_not_passed(any_backend, monkeypatch):
    monkeypatch.setenv("RLFLEET_TEST_SECRET", "s3cret")
    result = run_python("import os; print(sorted(os.environ.items()))", LIMITS)
    assert result.reason == "ok" and "s3cret" not in result.stdout


def test_the_cwd_is_empty_and_removed_afterwards(any_backend, monkeypatch, tmp_path):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    result = run_python("import os; print(os.listdir('.')); open('left', 'w').write('x')", LIMITS)
    assert (result.reason, result.stdout) == ("ok", "[]\n")
    assert list(tmp_path.iterdir()) == []


def test_capabilities_are_gone(any_backend):
    """Root of the user namespace (or a root worker) must not chroot, mount or unshare its way out."""
    result = run_python("import os; os.chroot('/')", LIMITS)
    assert result.reason == "exit" and "PermissionError" in result.stderr


def test_a_daemon_is_killed_with_the_run(any_backend):
    marker = f"daemon-{uuid.uuid4().hex}"
    code = f"""import os, time  # {marker}
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        time.sleep(30)
    os._exit(0)
time.sleep(0.2)
print("parent done")"""
    result = run_python(code, LIMITS)
    assert (kill_left_behind(marker), result.stdout) == ([], "parent done\n")


def test_a_fork_bomb_stops_at_the_process_limit(namespaces):
    # Bounded (200 forks at most), so that a runner without the limit fails this test instead of the machine.
    code = """import os, time
made = 0
try:
    for _ in range(200):
        if os.fork() == 0:
            time.sleep(5)
            os._exit(0)
        made += 1
except OSError:
    pass
print(made)"""
    result = run_python(code, LIMITS)
    assert result.reason == "ok" and int(result.stdout) < LIMITS.processes


def test_ordinary_subprocesses_fit_the_process_limit(namespaces):
    result = run_python("import subprocess, sys\nfor _ in range(4): subprocess.run([sys.executable, '-c', 'pass'], "
                        "check=True)\nprint('ok')", LIMITS)
    assert (result.reason, result.stdout) == ("ok", "ok\n"), result.stderr


def test_a_listener_on_the_hosts_loopback_is_unreachable(namespaces):
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        result = run_python(f"import socket; socket.create_connection(('127.0.0.1', {port}), timeout=1)\n"
                            "print('connected')", LIMITS)
    assert result.reason == "exit" and "connected" not in result.stdout


def test_the_workers_files_are_unreadable(namespaces, tmp_path):
    token = tmp_path / "token"
    token.write_text("fake-token")
    paths = [str(token), str(REPOSITORY / "pyproject.toml"), "/proc/1/environ"]  # the worktree is under /work
    code = f"""for path in {paths!r}:
    try:
        print(open(path).read()[:20])
    except OSError as error:
        print(type(error).__name__)"""
    result = run_python(code, LIMITS)
    assert (result.reason, result.stdout) == ("ok", "FileNotFoundError\n" * len(paths))


def test_a_sandbox_that_cannot_start_is_a_failed_call(namespaces, monkeypatch):
    monkeypatch.setattr(sandbox, "INTERPRETER", "/nonexistent/python")
    result = run_python("print(1)", LIMITS)
    assert (result.reason, result.exit_code) == ("unavailable", None) and "/nonexistent/python" in result.stderr
    assert run_code({"code": "print(1)"}, LIMITS)[1] is True


def test_the_fallback_is_chosen_by_the_variable_and_a_bad_value_is_refused(monkeypatch):
    monkeypatch.setenv(BACKEND_VARIABLE, "rlimits")
    assert backend() == "rlimits"
    monkeypatch.setenv(BACKEND_VARIABLE, "docker")
    with pytest.raises(ValueError, match=f"{BACKEND_VARIABLE}='docker': choose auto, unshare or rlimits"):
        backend()


def test_auto_probes_namespaces_here(monkeypatch):
    monkeypatch.delenv(BACKEND_VARIABLE, raising=False)
    sandbox._probed_backend.cache_clear()
    assert backend() == "unshare"


def test_the_tool_returns_output_or_a_short_error(namespaces):
    assert run_code({"code": "print(6 * 7)"}, LIMITS) == ("42\n", False)
    assert run_code({"code": "while True: pass"}, LIMITS.model_copy(update={"timeout_seconds": 0.5})) == \
        ("error: timed out after 0.5 s", True)
    text, error = run_code({"code": "print('so far'); 1 / 0"}, LIMITS)
    assert error and text.startswith("so far\nerror: exit status 1\n") and "ZeroDivisionError" in text
    assert run_code({"source": "print(1)"}, LIMITS) == ('python: the arguments need "code", a string of Python '
                                                        'source', True)


def kill_left_behind(marker: str) -> list[int]:
    """Kills the processes whose command line holds `marker` (a sandbox's are visible from here in /proc), which
    only a runner that fails these tests leaves behind; returns their pids."""
    found = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                if marker.encode() in cmdline.read():
                    found.append(int(entry))
        except OSError:
            continue  # it ended meanwhile
    for pid in found:
        os.kill(pid, signal.SIGKILL)
    return found
