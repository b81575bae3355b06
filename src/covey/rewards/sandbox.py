"""Run untrusted Python in a contained child process.

    result = run_python("print(6 * 7)", timeout=2.0, memory_limit_mb=256)
    result.status, result.stdout  # ("ok", "42\\n")

Every run gets a fresh temporary folder, an environment without the caller's variables, limits on
wall time, CPU time, memory, processes, file size and output, and is cleaned up completely: no process
it started outlives ``run_python``. How much more is isolated depends on what the machine allows
(``available_isolation``, probed once); docs/sandbox.md says what each level does and does not protect.
The trusted first process inside the sandbox is ``covey/sandbox_boot.py``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import enum
import fcntl
import functools
import json
import math
import os
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Iterator

from covey.rewards import sandbox_boot
from covey.errors import RewardError, warn

BOOT = Path(__file__).with_name("sandbox_boot.py")
INTERPRETER = os.path.realpath(sys.executable)
PROGRAM_ENV = {"PATH": "/usr/local/bin:/usr/bin:/bin", "LANG": "C.UTF-8", "HOME": "/nonexistent"}
FIRST_SANDBOX_UID, SANDBOX_UIDS = 3_000_000_000, 64  # one unused uid per concurrent program
GRACE_SECONDS = 2.0  # beyond the timeout, for starting and cleaning up, before the caller kills everything
CLEANUP_SECONDS = 1.0  # for a boot that is stopped early to clean up after its program, before it is killed
POLL_SECONDS = 0.05  # how often the caller checks whether the boot has ended while no output comes


class Isolation(enum.Enum):
    """How a program is contained, strongest first; every level has the resource limits."""

    NAMESPACES = "namespaces"  # as root: own network, PID, mount and IPC namespaces; an unprivileged uid
    USER_NAMESPACES = "user-namespaces"  # not root: the same namespaces inside a user namespace, your uid
    SEPARATE_USER = "separate-user"  # root without namespaces: an unprivileged uid only
    LIMITS_ONLY = "limits-only"  # neither: resource limits and a process group only

    @property
    def gaps(self) -> str:
        """What this level does not protect against (empty for the full one)."""
        return {
            Isolation.NAMESPACES: "",
            Isolation.USER_NAMESPACES: "the program runs as your user, so it can read the files your user can "
                                       "read (it can write none outside its folder and reach no network)",
            Isolation.SEPARATE_USER: "the program can open network connections, see other processes and write "
                                     "to world-writable places such as /tmp",
            Isolation.LIMITS_ONLY: "the program runs as your user: it can open network connections, read and "
                                   "write your files, and signal your processes, the trainer included",
        }[self]


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    status: str  # ok | error (exit code not 0) | timeout | memory | output_limit | killed (by a signal)
    returncode: int | None  # the exit code, -N for signal N, None when stopped at a limit
    stdout: str  # at most output_limit_bytes of each stream
    stderr: str
    seconds: float
    isolation: Isolation

    @property
    def ok(self) -> bool:
        return self.status == "ok"


def run_python(source: str, *, timeout: float, memory_limit_mb: int, output_limit_bytes: int = 64 * 1024,
               max_processes: int = 16, stdin: str = "", isolation: Isolation | None = None) -> SandboxResult:
    """Run ``source`` as a Python program (the standard library only) in a sandbox.

    ``timeout``: wall-clock seconds (CPU seconds are capped too); ``memory_limit_mb``: address space of
    each process, also the size of its private temporary folders; ``output_limit_bytes``: of stdout and
    of stderr, beyond which it is stopped; ``max_processes``: processes and threads it may have at once
    (binding where it runs as its own user); ``stdin``: what it reads from standard input, once.
    ``isolation``: the level to use (default: the strongest the machine allows).
    """
    level = isolation or available_isolation()
    memory = memory_limit_mb * 2**20
    limits = {"RLIMIT_AS": memory, "RLIMIT_CPU": math.ceil(timeout) + 1, "RLIMIT_NPROC": max_processes,
              "RLIMIT_FSIZE": memory, "RLIMIT_CORE": 0, "RLIMIT_NOFILE": 256}
    with _sandbox_uid(level) as uid, _working_folder() as folder:
        Path(folder, "main.py").write_text(source, encoding="utf-8")
        Path(folder, "stdin").write_text(stdin, encoding="utf-8")
        if uid is not None and level is Isolation.SEPARATE_USER:  # the program works in this folder
            os.chown(folder, uid, uid)
        report_read, report_write = os.pipe()
        settings = dict(isolation=level.value, folder=folder, uid=uid, timeout=timeout, limits=limits,
                        tmpfs_bytes=memory, env=PROGRAM_ENV, report_fd=report_write)
        start = time.monotonic()
        try:
            boot = subprocess.Popen([INTERPRETER, "-I", "-S", str(BOOT), json.dumps(settings)],
                                    stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                    env=PROGRAM_ENV, cwd=folder, start_new_session=True, pass_fds=(report_write,))
        finally:
            os.close(report_write)
        try:
            streams, stopped = _read_until_done(boot, report_read, start + timeout + GRACE_SECONDS, output_limit_bytes)
        finally:
            _end(boot)
            os.close(report_read)
            if uid is not None:
                _kill_processes_of(uid)
                _remove_what_is_left_of(uid)
        seconds = time.monotonic() - start
    stdout, stderr, report = (streams.get(k, b"") for k in ("stdout", "stderr", "report"))
    outcomes = [json.loads(line) for line in report.decode().splitlines()]
    errors = [o["setup_error"] for o in outcomes if "setup_error" in o]
    if errors:
        raise RewardError(f"the sandbox ({level.value}) could not start the program: {errors[0]}; "
                          "see docs/sandbox.md for what each isolation level needs")
    status, returncode = _classify(outcomes[-1] if outcomes else None, stderr, stopped)
    stdout, stderr = (data[:output_limit_bytes].decode("utf-8", errors="replace") for data in (stdout, stderr))
    return SandboxResult(status, returncode, stdout, stderr, seconds, level)


def _classify(outcome: dict | None, stderr: bytes, stopped: str | None) -> tuple[str, int | None]:
    """The status and return code of a run from the boot's report (None: the boot did not report) and
    why reading stopped early, if it did ("overflow" or "deadline")."""
    if stopped == "overflow":
        return "output_limit", None
    if stopped == "deadline" or (outcome is not None and "timeout" in outcome):
        return "timeout", None
    if outcome is None:  # the boot itself was killed
        return "killed", None
    if "signal" in outcome:
        return ("timeout" if outcome["signal"] == signal.SIGXCPU else "killed"), -outcome["signal"]
    code = outcome["exit"]
    if code == 0:
        return "ok", 0
    last_line = stderr.rstrip().rsplit(b"\n", 1)[-1]
    return ("memory" if last_line.startswith(b"MemoryError") else "error"), code


def _read_until_done(boot: subprocess.Popen, report: int, deadline: float,
                     limit: int) -> tuple[dict[str, bytes], str | None]:
    """Read stdout, stderr and the boot's report until all three close or the boot has ended; the bytes
    read, and why reading stopped early: "overflow" when stdout or stderr exceeded ``limit`` bytes,
    "deadline" when ``deadline`` passed first (else None).

    The boot ends only when nothing of the program is left, so then all it wrote is in the pipes: read
    what is there and stop. Waiting for end-of-file alone could last until the deadline, because a
    process that this one forks meanwhile (a reward worker, say) holds copies of the pipes' ends."""
    selector = selectors.DefaultSelector()
    for name, fd in (("stdout", boot.stdout.fileno()), ("stderr", boot.stderr.fileno()), ("report", report)):
        selector.register(fd, selectors.EVENT_READ, name)
    streams: dict[str, bytes] = {}
    try:
        while selector.get_map():
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return streams, "deadline"
            ended = _has_ended(boot.pid)
            events = selector.select(0 if ended else min(remaining, POLL_SECONDS))
            if ended and not events:
                break
            for key, _ in events:
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    selector.unregister(key.fd)
                    continue
                streams[key.data] = streams.get(key.data, b"") + chunk
                if key.data != "report" and len(streams[key.data]) > limit:
                    return streams, "overflow"
    finally:
        selector.close()
        boot.stdout.close()
        boot.stderr.close()
    return streams, None


def _has_ended(pid: int) -> bool:
    """Whether the child ``pid`` has exited, without reaping it (so its pid stays reserved)."""
    try:
        return os.waitid(os.P_PID, pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # already reaped: this process ignores SIGCHLD
        return True


def _end(boot: subprocess.Popen) -> None:
    """Leave nothing of the sandbox running, then reap the boot.

    A boot still running (output over the limit, deadline passed) is not simply killed with its group:
    a program that started a session of its own is not in that group, and with the boot gone nothing
    would clean up after it. So the processes below the boot are killed; the boot sees its program
    end, cleans up completely (as a child subreaper, or by ending its PID namespace) and exits. Only a
    boot that has not ended ``CLEANUP_SECONDS`` later is killed itself, right after another kill of
    what is below it."""
    give_up = time.monotonic() + CLEANUP_SECONDS
    while not _has_ended(boot.pid):
        sandbox_boot.kill_below(boot.pid)
        if time.monotonic() > give_up:
            break
        time.sleep(0.005)
    _kill_group(boot.pid)
    boot.wait()


def _kill_group(pgid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, signal.SIGKILL)


@contextlib.contextmanager
def _working_folder() -> Iterator[str]:
    """A fresh temporary folder, removed afterwards whatever the program left in it: folders it locked
    (made unreadable), or a tree nested too deep for ``shutil.rmtree``'s recursion."""
    folder = tempfile.mkdtemp(prefix="covey-sandbox-")
    try:
        yield folder
    finally:
        try:
            shutil.rmtree(folder)
        except (OSError, RecursionError):
            for command in (["chmod", "-R", "u+rwX", "--", folder], ["rm", "-rf", "--", folder]):
                subprocess.run(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


# where any user may write: what a program under a uid of its own leaves there is removed
WORLD_WRITABLE = ("/tmp", "/var/tmp", "/dev/shm")


def _remove_what_is_left_of(uid: int) -> None:
    """Remove what a program under a uid of its own left outside its folder: files and folders owned by
    ``uid`` in the world-writable folders, and System V shared memory, semaphores and message queues
    (which outlive processes and are not counted by their memory limit)."""
    for place in WORLD_WRITABLE:
        with contextlib.suppress(OSError):
            for entry in os.scandir(place):
                with contextlib.suppress(OSError):
                    if entry.stat(follow_symlinks=False).st_uid == uid:
                        subprocess.run(["rm", "-rf", "--", entry.path], stdout=subprocess.DEVNULL,
                                       stderr=subprocess.DEVNULL)
    libc = ctypes.CDLL(None, use_errno=True)
    for kind, (id_column, control) in SYSV_IPC.items():
        with contextlib.suppress(OSError):
            rows = [row.split() for row in Path(f"/proc/sysvipc/{kind}").read_text().splitlines()]
            for values in (dict(zip(rows[0], row)) for row in rows[1:] if row):
                if int(values["uid"]) == uid:
                    ident = int(values[id_column])
                    # semctl(id, semnum, cmd); shmctl and msgctl (id, cmd, buffer)
                    getattr(libc, control)(*((ident, 0, IPC_RMID) if kind == "sem" else (ident, IPC_RMID, None)))


# the System V IPC objects in /proc/sysvipc: the column of their id, and the call that controls them
SYSV_IPC = {"shm": ("shmid", "shmctl"), "sem": ("semid", "semctl"), "msg": ("msqid", "msgctl")}
IPC_RMID = 0  # the command of those calls that removes the object (Linux)


def _kill_processes_of(uid: int) -> None:
    """SIGKILL every process whose real uid is ``uid`` until none is left (a fork bomb racing the
    kill is bounded by its process limit, so this ends), then wait up to a second for the zombies to be
    reaped: until then they count against the next program's process limit under this uid."""
    deadline = time.monotonic() + 1.0
    while processes := _processes_of(uid):
        live = [pid for pid, state in processes if state not in "ZX"]
        if not live and time.monotonic() > deadline:
            return
        for pid in live:
            sandbox_boot.kill(pid)
        time.sleep(0.001)


def _processes_of(uid: int) -> list[tuple[int, str]]:
    """(pid, state letter) of every process whose real uid is ``uid``, from /proc."""
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            status = Path(f"/proc/{pid}/status").read_text()
        except OSError:  # exited meanwhile
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        if int(fields["Uid"].split()[0]) == uid:
            found.append((int(pid), fields["State"].split()[0]))
    return found


@contextlib.contextmanager
def _sandbox_uid(level: Isolation) -> Iterator[int | None]:
    """An unprivileged uid no other sandbox uses meanwhile (None where the level runs as the caller).

    A separate uid per concurrent program makes the process limit count only that program's
    processes, and lets the cleanup kill by uid. A lock file per uid makes the choice exclusive
    across processes on the machine (several trainers, several ranks)."""
    if level not in (Isolation.NAMESPACES, Isolation.SEPARATE_USER):
        yield None
        return
    locks = Path(tempfile.gettempdir(), "covey-sandbox-uids")
    locks.mkdir(mode=0o700, exist_ok=True)
    while True:
        for uid in range(FIRST_SANDBOX_UID, FIRST_SANDBOX_UID + SANDBOX_UIDS):
            fd = os.open(locks / str(uid), os.O_CREAT | os.O_RDWR, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            try:
                yield uid
            finally:
                os.close(fd)
            return
        time.sleep(0.05)  # all in use: wait for one


@functools.cache
def available_isolation() -> Isolation:
    """The strongest isolation this machine allows, found once by running a trivial program at each
    level in turn. Anything weaker than namespaces is announced with a warning that says what it
    does not protect against."""
    candidates = ([Isolation.NAMESPACES, Isolation.SEPARATE_USER] if os.geteuid() == 0
                  else [Isolation.USER_NAMESPACES]) + [Isolation.LIMITS_ONLY]
    failures = []
    for level in candidates:
        try:
            result = run_python("print('ready')", timeout=10.0, memory_limit_mb=256, isolation=level)
        except RewardError as e:
            failures.append(str(e))
            continue
        if result.stdout == "ready\n":
            if level is not Isolation.NAMESPACES:
                warn(f"code sandbox: namespaces as root are not available here, using "
                              f"{level.value}: {level.gaps}. See docs/sandbox.md.", RuntimeWarning, stacklevel=2)
            return level
        failures.append(f"{level.value}: the test program ended with {result.status}: {result.stderr[-300:]}")
    raise RewardError("no sandbox level works on this machine: " + "; ".join(failures))
