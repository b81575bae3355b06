"""The trusted first process of a sandbox (see ``covey.rewards.sandbox``).

It enters the isolation, starts the program with its limits, enforces the wall time, reports how the
program ended, and leaves nothing of it running. It runs as its own script under ``python -I -S``, so it
uses the standard library only and imports nothing from covey. ``covey.rewards.sandbox`` imports it too, for
``kill_below``; importing it starts nothing.

    python -I -S sandbox_boot.py SETTINGS_JSON

Settings: ``isolation`` (a ``covey.rewards.sandbox.Isolation`` value), ``folder`` (holds ``main.py`` and
``stdin``), ``uid`` (the unprivileged user to run as, or null), ``timeout`` (wall seconds),
``limits`` (resource name -> value), ``tmpfs_bytes``, ``env`` and ``report_fd``. The report is
one JSON object per line on ``report_fd``: ``{"exit": code}``, ``{"signal": number}``,
``{"timeout": true}`` or ``{"setup_error": message}``.
"""

from __future__ import annotations

import ctypes
import json
import os
import re
import resource
import signal
import stat
import sys
import time

CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWUTS = 0x00020000, 0x08000000, 0x04000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_REMOUNT = 1, 2, 4, 8, 32
MS_BIND, MS_REC, MS_PRIVATE = 4096, 16384, 1 << 18
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
USER_NAMESPACE_UID = 65534  # who the program is inside a user namespace (mapped to the caller's own uid)
WORK_FOLDER = "/tmp/work"  # the working folder inside namespaces
PROGRAM_FLAGS = ["-I", "-S", "-B", "-X", "utf8"]  # isolated mode, no site-packages, no .pyc, UTF-8 I/O

libc = ctypes.CDLL(None, use_errno=True)


def check(result: int, what: str) -> None:
    if result != 0:
        errno = ctypes.get_errno()
        raise OSError(errno, f"{what}: {os.strerror(errno)}")


def c_string(text: str | None) -> bytes | None:
    return None if text is None else text.encode()


def mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    check(libc.mount(c_string(source), c_string(target), c_string(fstype), ctypes.c_ulong(flags), c_string(data)),
          f"mount {target}")


def die_with_parent() -> None:
    """SIGKILL this process when its parent dies (cleared by a change of user, so set it after one)."""
    parent = os.getppid()
    check(libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0), "prctl(PDEATHSIG)")
    if os.getppid() != parent:
        os._exit(1)


# ---- namespaces ---------------------------------------------------------------------------------


def enter_namespaces(user_namespace: bool) -> None:
    """New network, mount, PID, IPC and UTS namespaces (inside a user namespace when not root).

    The caller stays outside the new PID namespace, so this forks: the outer process waits and
    exits; the inner one returns as PID 1, and when it exits the kernel kills every process left in
    the namespace.
    """
    flags = CLONE_NEWNET | CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS
    uid, gid = os.geteuid(), os.getegid()
    check(libc.unshare(flags | (CLONE_NEWUSER if user_namespace else 0)), "unshare")
    if user_namespace:
        for name, text in (("setgroups", "deny"), ("uid_map", f"{USER_NAMESPACE_UID} {uid} 1"),
                           ("gid_map", f"{USER_NAMESPACE_UID} {gid} 1")):
            with open(f"/proc/self/{name}", "w") as f:
                f.write(text)
    inner = os.fork()
    if inner:
        os.waitpid(inner, 0)
        os._exit(0)
    die_with_parent()


def mount_points() -> list[str]:
    """Every mount point of this mount namespace, parents before children."""
    with open("/proc/self/mountinfo") as f:
        points = [line.split()[4] for line in f]
    return [re.sub(r"\\([0-7]{3})", lambda m: chr(int(m.group(1), 8)), p) for p in points]


def remount_read_only(path: str) -> None:
    """Make one mount read-only, keeping its nosuid/nodev/noexec (a user namespace must keep them)."""
    kept = os.statvfs(path).f_flag & (os.ST_NOSUID | os.ST_NODEV | os.ST_NOEXEC)
    mount(None, path, None, MS_REMOUNT | MS_BIND | MS_RDONLY | kept)


def hidden_ancestor(path: str) -> str | None:
    """The highest folder on the way to ``path`` that other users may not enter, if any."""
    parts = path.strip("/").split("/")
    for depth in range(1, len(parts) + 1):
        folder = "/" + "/".join(parts[:depth])
        if not os.stat(folder).st_mode & stat.S_IXOTH:
            return folder
    return None


def interpreter_folders() -> list[str]:
    """The folders the interpreter runs from: its install prefix and the folder of its binary."""
    folders = {os.path.realpath(sys.base_prefix), os.path.dirname(os.path.realpath(sys.executable))}
    return sorted(f for f in folders if not any(f.startswith(o + "/") for o in folders))


def build_filesystem(folder: str, uid: int | None, tmpfs_bytes: int) -> str:
    """The program's view of the files: everything read-only, a fresh /proc for the new PID
    namespace, private tmpfs on /tmp and /dev/shm, and a working folder in the private /tmp holding
    a copy of ``folder``'s main.py. Returns the working folder.

    When the program runs as another user and the interpreter lives under a folder that other users
    cannot enter (a home folder), that folder is covered with an empty tmpfs and only the
    interpreter's own folders are mounted back into it, read-only.
    """
    mount(None, "/", None, MS_REC | MS_PRIVATE)
    with open(os.path.join(folder, "main.py"), "rb") as f:
        source = f.read()
    hidden = {path: hidden_ancestor(path) for path in interpreter_folders()} if uid is not None else {}
    exposed = {path: os.open(path, os.O_PATH | os.O_DIRECTORY) for path, above in hidden.items() if above}
    for point in mount_points():
        if point != "/proc" and not point.startswith("/proc/"):
            remount_read_only(point)
    mount("proc", "/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    for covered in {hidden[path] for path in exposed}:
        mount("tmpfs", covered, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,mode=755")
    for path, fd in exposed.items():
        os.makedirs(path, mode=0o755, exist_ok=True)
        mount(f"/proc/self/fd/{fd}", path, None, MS_BIND | MS_REC)
        remount_read_only(path)
        os.close(fd)
    for point in ("/tmp", "/dev/shm"):
        mount("tmpfs", point, "tmpfs", MS_NOSUID | MS_NODEV, f"size={tmpfs_bytes},mode=1777")
    os.mkdir(WORK_FOLDER, mode=0o700)
    with open(os.path.join(WORK_FOLDER, "main.py"), "wb") as f:
        f.write(source)
    if uid is not None:
        os.chown(WORK_FOLDER, uid, uid)
    return WORK_FOLDER


# ---- the program --------------------------------------------------------------------------------


def start_program(settings: dict, folder: str, stdin: int, report: int) -> None:
    """In the forked child: limits, stdin, user, then exec the interpreter on main.py. Never returns."""
    try:
        os.dup2(stdin, 0)
        for name, value in settings["limits"].items():
            _, hard = resource.getrlimit(getattr(resource, name))
            value = value if hard == resource.RLIM_INFINITY else min(value, hard)  # only root may raise one
            resource.setrlimit(getattr(resource, name), (value, value))
        uid = settings["uid"]
        if uid is not None:
            os.setgroups([])
            os.setresgid(uid, uid, uid)
            os.setresuid(uid, uid, uid)
        check(libc.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(NO_NEW_PRIVS)")
        die_with_parent()
        os.chdir(folder)
        os.execve(sys.executable, [sys.executable, *PROGRAM_FLAGS, "main.py"], settings["env"])
    except Exception as e:  # reported to the caller, who raises it
        write_report(report, {"setup_error": f"starting the program: {type(e).__name__}: {e}"})
    os._exit(127)


def wait_for(pid: int, timeout: float) -> dict:
    """Wait for the program, killing it at ``timeout`` seconds; how it ended, as a report."""
    timed_out = False

    def on_alarm(*_) -> None:
        nonlocal timed_out
        timed_out = True
        os.kill(pid, signal.SIGKILL)

    signal.signal(signal.SIGALRM, on_alarm)
    signal.setitimer(signal.ITIMER_REAL, timeout)
    _, status = os.waitpid(pid, 0)
    signal.setitimer(signal.ITIMER_REAL, 0)
    if timed_out:
        return {"timeout": True}
    if os.WIFSIGNALED(status):
        return {"signal": os.WTERMSIG(status)}
    return {"exit": os.waitstatus_to_exitcode(status)}


def kill_below(root: int) -> None:
    """SIGKILL the live processes below ``root`` that one walk of /proc finds.

    The walk reads the newest processes first and kills a child of ``root`` as soon as it reads it: in
    a chain of processes that each fork a successor and exit at once, the link alive now is gone long
    before a walk of a busy machine ends, and where ``root`` is a child subreaper the oldest live link
    is its child."""
    children: dict[int, list[int]] = {}
    for pid in sorted((int(entry) for entry in os.listdir("/proc") if entry.isdigit()), reverse=True):
        try:
            with open(f"/proc/{pid}/stat") as f:
                state, parent = f.read().rsplit(")", 1)[1].split()[:2]
        except OSError:  # gone meanwhile
            continue
        if state not in "ZX":
            children.setdefault(int(parent), []).append(pid)
            if int(parent) == root:
                kill(pid)
    todo = children.get(root, [])
    while todo:
        below = [child for pid in todo for child in children.get(pid, [])]
        for pid in below:
            kill(pid)
        todo = below


def kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def kill_descendants() -> None:
    """Kill every process the program left, and reap them. This process is a child subreaper, so
    orphans, even ones that started their own session, become its children instead of init's: while
    any process is left below it, it has a child. So it repeats until it has none, not until a walk
    of /proc finds nothing (a walk misses a process forked by one that exits during it)."""
    while reap_children():
        kill_below(os.getpid())
        time.sleep(0.001)


def reap_children() -> bool:
    """Collect the exit status of every child that has ended; whether any child is left."""
    try:
        while os.waitpid(-1, os.WNOHANG)[0] > 0:
            pass
    except ChildProcessError:
        return False
    return True


def write_report(report: int, outcome: dict) -> None:
    os.write(report, (json.dumps(outcome) + "\n").encode())


def main() -> None:
    settings = json.loads(sys.argv[1])
    report = settings["report_fd"]
    os.set_inheritable(report, False)
    die_with_parent()
    namespaces = settings["isolation"] in ("namespaces", "user-namespaces")
    folder = settings["folder"]
    try:
        stdin = os.open(os.path.join(folder, "stdin"), os.O_RDONLY)
        os.unlink(os.path.join(folder, "stdin"))  # read once, through fd 0 only
        if namespaces:
            enter_namespaces(user_namespace=settings["isolation"] == "user-namespaces")
            folder = build_filesystem(folder, settings["uid"], settings["tmpfs_bytes"])
        else:
            check(libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0), "prctl(CHILD_SUBREAPER)")
    except Exception as e:  # reported to the caller, who raises it
        write_report(report, {"setup_error": f"{settings['isolation']}: {type(e).__name__}: {e}"})
        sys.exit(1)
    program = os.fork()
    if program == 0:
        start_program(settings, folder, stdin, report)
    outcome = wait_for(program, settings["timeout"])
    if not namespaces:  # in a PID namespace the kernel does this when this process exits
        kill_descendants()
    write_report(report, outcome)


if __name__ == "__main__":
    main()
