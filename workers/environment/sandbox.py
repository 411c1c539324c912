"""The python tool's sandbox: runs the policy's code in a separate process with the job's limits (config.Sandbox),
no network, none of the worker's files, credentials or environment, and kills every process the code started.

`backend()` says how this machine isolates (docs/environments.md, "The python tool's sandbox"):
- "unshare": Linux namespaces made by sandbox_init.py itself (user, mount, pid, net, ipc, uts; no package needed),
- "rlimits": where namespaces are refused (Kubernetes' restricted profile): limits, a clean env and an empty cwd only.
It is probed once; RLFLEET_SANDBOX=unshare|rlimits chooses one instead (auto, the default, probes).
"""

from __future__ import annotations

import functools
import json
import logging
import os
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from rlfleet.workers.environment.config import Sandbox

log = logging.getLogger(__name__)

BACKENDS = ("unshare", "rlimits")
BACKEND_VARIABLE = "RLFLEET_SANDBOX"
OUTPUT_CHARS = 8000
"""Characters of stdout (its head) and of stderr (its tail, where a traceback ends) that a result keeps."""
CODE_CHARS = 100_000
"""Longest code run: it travels as one argument, which Linux bounds at 128 KiB."""
GRACE_SECONDS = 10.0
"""Past the code's own timeout, how long the sandbox may take to set up and clean up before it is killed whole."""
INIT = Path(__file__).with_name("sandbox_init.py")
INTERPRETER = os.path.realpath(sys.executable)
"""The worker's own interpreter, outside its virtual environment: the code imports the standard library only."""


@dataclass(frozen=True)
class SandboxResult:
    stdout: str
    stderr: str
    exit_code: int | None
    """The code's exit status; minus the signal that killed it; None when it timed out or never ran."""
    reason: str
    """"ok", "exit" (nonzero), "timeout", "memory", "killed" (a signal) or "unavailable" (the sandbox failed)."""
    seconds: float


def backend() -> str:
    """"unshare" or "rlimits": RLFLEET_SANDBOX's choice, or what the probe found (once per process)."""
    chosen = os.environ.get(BACKEND_VARIABLE, "auto")
    if chosen == "auto":
        return _probed_backend()
    if chosen not in BACKENDS:
        raise ValueError(f"{BACKEND_VARIABLE}={chosen!r}: choose auto, {' or '.join(BACKENDS)}")
    return chosen


@functools.cache
def _probed_backend() -> str:
    probe = _run("pass", Sandbox(), "", "unshare")
    if probe.reason == "ok":
        return "unshare"
    log.warning("python tool sandbox: no namespaces here (%s); code runs with rlimits only, not isolated from "
                "the network or the worker's files", probe.stderr.strip() or probe.reason)
    return "rlimits"


def run_python(code: str, limits: Sandbox, stdin: str = "") -> SandboxResult:
    """Runs `code` with `python -I -S` (the standard library, nothing installed) in the sandbox."""
    if len(code) > CODE_CHARS:
        return SandboxResult("", f"code of {len(code)} characters; at most {CODE_CHARS}", None, "unavailable", 0.0)
    return _run(code, limits, stdin, backend())


def _run(code: str, limits: Sandbox, stdin: str, chosen: str) -> SandboxResult:
    start = time.monotonic()
    try:
        with tempfile.TemporaryDirectory(prefix="rlfleet-sandbox-", ignore_cleanup_errors=True) as work:
            status, stdout, stderr = _run_in(Path(work), code, limits, stdin, chosen)
    except OSError as error:  # no process, no pipe, a full disk: the call fails, never the episode's caller
        return SandboxResult("", f"sandbox: {error}", None, "unavailable", time.monotonic() - start)
    return _result(status, stdout, stderr, time.monotonic() - start)


def _run_in(work: Path, code: str, limits: Sandbox, stdin: str, chosen: str) -> tuple[dict, str, str]:
    root = work / "root"  # the code's cwd with rlimits only
    root.mkdir()
    (work / "stdin").write_text(stdin)
    status_read, status_write = os.pipe()
    try:
        settings = _settings(code, limits, chosen, root, status_write)
        (work / "settings.json").write_text(json.dumps(settings))
        with open(work / "stdin", "rb") as into, open(work / "stdout", "wb+") as out, \
                open(work / "stderr", "wb+") as err:
            try:
                process = subprocess.Popen(
                    [INTERPRETER, "-I", "-S", str(INIT), str(work / "settings.json")], stdin=into, stdout=out,
                    stderr=err, pass_fds=(status_write,), start_new_session=True, cwd=root,
                    env=_clean_env(settings["home"]))
            finally:
                os.close(status_write)
            _wait(process, limits.timeout_seconds + GRACE_SECONDS)
            return _status(status_read), _head(out), _tail(err)
    finally:
        os.close(status_read)


def _settings(code: str, limits: Sandbox, chosen: str, root: Path, status_fd: int) -> dict:
    return {
        "backend": chosen, "code": code, "python": INTERPRETER, "status_fd": status_fd,
        "home": "/tmp" if chosen == "unshare" else str(root),
        "dirs": sorted({os.path.realpath(sys.base_prefix), os.path.dirname(INTERPRETER)}),
        "timeout_seconds": limits.timeout_seconds, "memory_mib": limits.memory_mib,
        "nproc": _nproc(limits, chosen),
    }


def _nproc(limits: Sandbox, chosen: str) -> int:
    """RLIMIT_NPROC counts the tasks of the real uid: inside a user namespace only the sandbox's own, outside
    every process and thread of the worker's uid, which the code's allowance comes on top of."""
    if chosen == "unshare":  # the namespace's init counts, and so does its parent unless it is uid 0 outside
        return limits.processes + (1 if os.geteuid() == 0 else 2)
    uid, tasks = os.getuid(), 0
    for entry in os.listdir("/proc"):
        try:
            if entry.isdigit() and os.stat(f"/proc/{entry}").st_uid == uid:
                tasks += len(os.listdir(f"/proc/{entry}/task"))
        except OSError:
            continue  # it ended meanwhile
    return tasks + limits.processes + 1


def _clean_env(home: str) -> dict[str, str]:
    """Nothing of the worker's own environment (tokens, endpoints): a path, a UTF-8 locale, a home and temp dir."""
    return {"PATH": "/usr/local/bin:/usr/bin:/bin", "LC_ALL": "C.UTF-8", "HOME": home, "TMPDIR": home}


def _wait(process: subprocess.Popen, seconds: float) -> None:
    try:
        process.wait(seconds)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)  # its namespaces' processes die with their init, in this group
        process.wait()


def _status(status_read: int) -> dict:
    os.set_blocking(status_read, False)  # a process left behind may still hold the other end
    try:
        line = os.read(status_read, 4096).decode()
    except BlockingIOError:
        line = ""
    return json.loads(line) if line.strip() else {"setup": "the sandbox ended without a status"}


def _head(file) -> str:
    file.seek(0)
    text = file.read(OUTPUT_CHARS * 4).decode(errors="replace")  # UTF-8: at most 4 bytes a character
    return text if len(text) <= OUTPUT_CHARS and not file.read(1) else text[:OUTPUT_CHARS] + "\n[truncated]"


def _tail(file) -> str:
    start = max(0, file.seek(0, os.SEEK_END) - OUTPUT_CHARS * 4)
    file.seek(start)
    text = file.read().decode(errors="replace")
    return text if start == 0 and len(text) <= OUTPUT_CHARS else "[truncated]\n" + text[-OUTPUT_CHARS:]


def _result(status: dict, stdout: str, stderr: str, seconds: float) -> SandboxResult:
    if "setup" in status:
        return SandboxResult(stdout, f"sandbox: {status['setup']}\n{stderr}", None, "unavailable", seconds)
    if status.get("timeout"):
        return SandboxResult(stdout, stderr, None, "timeout", seconds)
    if "signal" in status:
        reason = "timeout" if status["signal"] == signal.SIGXCPU else "killed"
        return SandboxResult(stdout, stderr, -status["signal"], reason, seconds)
    code = status["exit"]
    if code == 0:
        return SandboxResult(stdout, stderr, 0, "ok", seconds)
    last = stderr.strip().rsplit("\n", 1)[-1]
    return SandboxResult(stdout, stderr, code, "memory" if last.startswith("MemoryError") else "exit", seconds)


def run_code(arguments: dict, limits: Sandbox) -> tuple[str, bool]:
    """The python tool: runs arguments["code"]; returns the text the model reads and whether the call failed."""
    code = arguments.get("code")
    if not isinstance(code, str):
        return 'python: the arguments need "code", a string of Python source', True
    result = run_python(code, limits)
    if result.reason == "ok":
        return result.stdout + result.stderr, False
    return result.stdout + _error(result, limits), True


def _error(result: SandboxResult, limits: Sandbox) -> str:
    if result.reason == "timeout":
        return f"error: timed out after {limits.timeout_seconds:g} s"
    if result.reason == "memory":
        return f"error: out of memory (the limit is {limits.memory_mib} MiB)\n{result.stderr}"
    if result.reason == "killed":
        return f"error: killed by {signal.Signals(-result.exit_code).name}\n{result.stderr}"
    if result.reason == "unavailable":
        return f"error: the sandbox could not run the code: {result.stderr}"
    return f"error: exit status {result.exit_code}\n{result.stderr}"
