"""The sandbox's own init: runs as `python -I -S sandbox_init.py SETTINGS_FILE` (stdlib only: the package is not
importable there), isolates itself, runs the untrusted code as a child with rlimits, and reports one JSON line
on the status descriptor: {"exit": n}, {"signal": n}, {"timeout": true} or {"setup": "why"}.

With namespaces ("unshare") the code runs as root of a fresh user namespace mapped to one unprivileged uid
outside, with no capabilities, alone in new pid, net, ipc, uts and mount namespaces whose root is a tmpfs
holding read-only binds of the interpreter's directories only. Without ("rlimits") it runs in the worker's
namespaces and this process, a child subreaper, kills whatever the code left behind.
"""

import ctypes
import json
import os
import platform
import resource
import signal
import stat
import sys

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MNT_DETACH = 2
PR_SET_PDEATHSIG, PR_CAPBSET_DROP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 24, 36, 38
PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL = 47, 4
NOBODY = 65534
"""The uid outside that a root worker's sandbox runs as: RLIMIT_NPROC never binds uid 0."""
SYSTEM_DIRS = ("/usr", "/lib", "/lib64", "/lib32", "/bin", "/sbin")
DEVICES = ("/dev/null", "/dev/zero", "/dev/random", "/dev/urandom")
MOUNT_POINT = "/tmp"
"""Where the new root is mounted (inside the sandbox's mount namespace only) before it becomes /: a directory the
namespace's root may search, which nobody, for a root worker, may not in the worker's temporary directory."""
TMPFS_MIB = 64
"""Size of the sandbox's root filesystem, its /tmp (the code's cwd) included."""
FILE_BYTES = 16 * 2**20
"""Largest file the code may write (RLIMIT_FSIZE): its stdout and stderr are files too."""

SYS_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41}
libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")


def prctl(option: int, value: int = 0) -> None:
    check(libc.prctl(option, ctypes.c_ulong(value), 0, 0, 0), f"prctl({option})")


def mount(source: str | None, target: str, kind: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(c_string(source), c_string(target), c_string(kind), ctypes.c_ulong(flags), c_string(data)),
          f"mount {source or kind} on {target}")


def c_string(text: str | None) -> bytes | None:
    return None if text is None else os.fsencode(text)


def report(status: int, message: dict) -> None:
    os.write(status, (json.dumps(message) + "\n").encode())


def main() -> None:
    with open(sys.argv[1]) as file:
        settings = json.load(file)
    status = settings["status_fd"]
    try:
        if settings["backend"] == "unshare":
            enter_namespaces(settings)  # returns in the new pid namespace's init only
        else:
            prctl(PR_SET_CHILD_SUBREAPER, 1)  # orphans, daemons included, come back to this process
    except OSError as error:
        report(status, {"setup": str(error)})
        os._exit(1)
    report(status, supervise(settings))
    os._exit(0)


def enter_namespaces(settings: dict) -> None:
    """Forks twice: the first child unshares the namespaces once this process has mapped its uid (only a process
    outside may map a uid other than its own), the second is the new pid namespace's init and returns."""
    go_read, go_write = os.pipe()
    ready_read, ready_write = os.pipe()
    root = os.geteuid() == 0
    outer = (NOBODY, NOBODY) if root else (os.geteuid(), os.getegid())
    if root:
        os.setgroups([])  # root's groups would stay in the sandbox's credentials
    child = os.fork()
    if child == 0:
        os.close(go_write)
        os.close(ready_read)
        prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        check(libc.unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS),
              "unshare")
        os.write(ready_write, b"1")
        if os.read(go_read, 1) != b"1":
            os._exit(1)
        init = os.fork()
        if init == 0:
            prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
            isolate_files(settings)
            return
        os.waitpid(init, 0)
        os._exit(0)
    os.close(go_read)
    os.close(ready_write)
    if os.read(ready_read, 1) != b"1":
        os._exit(1)
    write_maps(child, outer)
    os.write(go_write, b"1")
    os.waitpid(child, 0)
    os._exit(0)


def write_maps(pid: int, outer: tuple[int, int]) -> None:
    """Root of the namespace is one unprivileged uid and gid outside: the worker's own, or nobody for root."""
    for name, text in (("setgroups", "deny"), ("uid_map", f"0 {outer[0]} 1"), ("gid_map", f"0 {outer[1]} 1")):
        with open(f"/proc/{pid}/{name}", "w") as file:
            file.write(text)


def isolate_files(settings: dict) -> None:
    """Makes a tmpfs the root: read-only binds of the interpreter's directories and a few devices, an empty /tmp;
    the old root is detached, so nothing else of the machine is reachable from the new one."""
    links, sources = {}, {}
    for path in covering([*SYSTEM_DIRS, *settings["dirs"]]):
        if os.path.islink(path):
            links[path] = os.readlink(path)
        elif os.path.isdir(path):
            sources[path] = os.open(path, os.O_PATH)
    # Opened before this process becomes the namespace's root: root's kuid outside is nobody, who may not search
    # the directories above the interpreter (/root/.pyenv, say); an opened one binds from /proc/self/fd.
    sources.update({device: os.open(device, os.O_PATH) for device in DEVICES})
    os.setresgid(0, 0, 0)
    os.setresuid(0, 0, 0)
    root = MOUNT_POINT
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    mount("tmpfs", root, "tmpfs", MS_NOSUID | MS_NODEV, f"size={TMPFS_MIB}m,mode=755")
    for path, target in links.items():
        os.symlink(target, root + path)
    os.makedirs(root + "/dev")
    for path, source in sources.items():
        bind(f"/proc/self/fd/{source}", root + path, directory=stat.S_ISDIR(os.stat(source).st_mode))
        os.close(source)
    os.makedirs(root + "/tmp")
    os.chmod(root + "/tmp", 0o1777)
    os.chdir(root)
    check(libc.syscall(SYS_PIVOT_ROOT[platform.machine()], b".", b"."), "pivot_root")  # the old root lies under it
    check(libc.umount2(b".", MNT_DETACH), "umount old root")
    os.chdir("/tmp")


def covering(paths: list[str]) -> list[str]:
    """The paths that no earlier one contains."""
    kept: list[str] = []
    for path in paths:
        if not any(path == done or path.startswith(done + "/") for done in kept):
            kept.append(path)
    return kept


def bind(source: str, target: str, directory: bool) -> None:
    if directory:
        os.makedirs(target, exist_ok=True)
    else:
        open(target, "w").close()
    mount(source, target, None, MS_BIND | MS_REC)
    # A user namespace may not clear the flags the mount had outside: keep them and add read-only.
    kept = {os.ST_NOSUID: MS_NOSUID, os.ST_NODEV: MS_NODEV, os.ST_NOEXEC: MS_NOEXEC}
    flags = sum(ms for st, ms in kept.items() if os.statvfs(target).f_flag & st)
    mount(None, target, None, MS_BIND | MS_REMOUNT | MS_RDONLY | flags)


def supervise(settings: dict) -> dict:
    """Runs the code; past the timeout kills it. Either way every process it started is killed and reaped."""
    code = os.fork()
    if code == 0:
        run_code(settings)
    signal.signal(signal.SIGALRM, timed_out)
    signal.setitimer(signal.ITIMER_REAL, settings["timeout_seconds"])
    try:
        result = wait_for(code)
    except TimeoutError:
        result = {"timeout": True}
    signal.setitimer(signal.ITIMER_REAL, 0)
    kill_the_rest()
    return result


def timed_out(signum, frame) -> None:
    raise TimeoutError


def wait_for(code: int) -> dict:
    while True:  # reaps orphans on the way: they would count against RLIMIT_NPROC until reaped
        pid, wait_status = os.waitpid(-1, 0)
        if pid == code:
            if os.WIFSIGNALED(wait_status):
                return {"signal": os.WTERMSIG(wait_status)}
            return {"exit": os.WEXITSTATUS(wait_status)}


def kill_the_rest() -> None:
    while True:
        # The namespace's init kills every other process in it at once; a subreaper, its children one by one.
        for pid in [-1] if os.getpid() == 1 else children():
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass  # it ended meanwhile, or nothing was left
        try:
            os.waitpid(-1, 0)
        except ChildProcessError:
            return


def children() -> list[int]:
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        try:
            with open(f"/proc/{entry}/stat") as file:
                fields = file.read().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue  # not a process, or it ended meanwhile
        if int(fields[1]) == me:
            found.append(int(entry))
    return found


def run_code(settings: dict) -> None:
    try:
        os.close(settings["status_fd"])
        drop_capabilities()
        for limit, value in limits(settings).items():
            resource.setrlimit(limit, (value, value))
        os.execv(settings["python"], [settings["python"], "-I", "-S", "-c", settings["code"]])
    except (OSError, ValueError) as error:  # ValueError: a NUL character in the code
        os.write(2, f"sandbox: {error}\n".encode())
    os._exit(127)  # a fork of the init: never return into the init's own code


def drop_capabilities() -> None:
    """Root of the user namespace execs with the bounding set as its capabilities: empty it, so the code cannot
    mount, chroot or unshare its way out. No new privileges either (no set-uid binary gives any back)."""
    prctl(PR_SET_NO_NEW_PRIVS, 1)
    if os.getuid() != 0:
        return  # the rlimits backend: the worker's own uid, which execs with no capabilities unless it is root
    prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL)
    capability = 0
    while libc.prctl(PR_CAPBSET_DROP, ctypes.c_ulong(capability), 0, 0, 0) == 0:
        capability += 1  # until EINVAL: one past the kernel's last capability


def limits(settings: dict) -> dict:
    return {
        resource.RLIMIT_AS: settings["memory_mib"] * 2**20,
        resource.RLIMIT_CPU: int(settings["timeout_seconds"]) + 1,  # the wall clock kills first
        resource.RLIMIT_NPROC: settings["nproc"],
        resource.RLIMIT_FSIZE: FILE_BYTES,
        resource.RLIMIT_CORE: 0,
    }


if __name__ == "__main__":
    main()
