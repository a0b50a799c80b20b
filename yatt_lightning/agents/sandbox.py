"""The ``python`` tool: the model's code in a separate process, isolated by the operating system.

Each call runs a fresh base interpreter (``python -I -S``: no site, no environment read; the venv is not
mounted) under bubblewrap (``bwrap``), which puts it in new namespaces of every kind. A user namespace of its
own where the trainer is not root; as root, bwrap builds the namespaces and ``setpriv`` then drops to an
unprivileged uid of the call's own with every capability gone, so that:

- files: a mount namespace holding only read-only binds of ``/usr`` (and the ``/bin``, ``/lib`` links) and of
  the interpreter's own prefix, a fresh ``/proc`` and minimal ``/dev``, and two small tmpfs of its own:
  ``/tmp`` and ``/sandbox`` (its working directory and home). No ``/etc``, ``/root``, ``/home``, run folder,
  checkpoints, venv or caches exist there, and nothing it writes reaches the host;
- network: a network namespace with nothing but its own loopback, so no host port and no name resolves;
- processes: a pid namespace (it sees only its own processes; killing its init on timeout kills them all),
  a new session, ipc and uts namespaces, no capabilities, no new user namespaces (seccomp, and bwrap's
  ``--disable-userns`` where it has one);
- other episodes: each call has its own namespaces and tmpfs, and as root its own uid (root on the host is
  exempt from ``RLIMIT_NPROC``; that uid is not, and shares its process budget with no one);
- resources: a wall-clock timeout, and ``setrlimit`` of address space (``memory_mb``), CPU seconds, file
  size, open files, core dumps and processes (``RLIMIT_NPROC``, set inside too, so it holds for any user).

Inside, an audit hook (:pep:`578`) refuses sockets, new processes, ``ctypes`` and writes outside the working
directory with a clear ``PermissionError``: that tells honest code what is not allowed; the namespaces are
what holds when code removes the hook. Output (stdout and stderr) is cut to ``max_output_chars``.

Without bubblewrap (or where the kernel refuses user namespaces) :class:`Python` refuses to start, unless
built with ``unsafe=True``: then only the audit hook and the limits fence the code, which code written to
escape gets around. A kernel exploit is out of any namespace's reach: for hostile workloads add a VM.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import os
import platform
import resource
import shutil
import signal
import struct
import subprocess
import sys
import tempfile
import warnings

from yatt_lightning.agents.tools import Tool, ToolError

# Runs in the child before the model's code (read from stdin): the audit hook, then the code.
_BOOT = r"""
import os, sys
_root = os.path.realpath(os.getcwd())
def _inside(path):
    try:
        path = os.fsdecode(path)
    except TypeError:
        return True
    real = os.path.realpath(os.path.join(_root, path))
    return real == _root or real.startswith(_root + os.sep)
_WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC
_PATHS = {"os.remove", "os.rename", "os.replace", "os.mkdir", "os.rmdir", "os.symlink", "os.link", "os.chmod",
          "os.chown", "os.truncate", "os.utime", "shutil.rmtree", "shutil.move", "shutil.copyfile"}
_PROCESSES = ("subprocess.", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork", "os.forkpty",
              "pty.", "os.kill", "os.killpg", "ctypes.", "socket.")
def _hook(event, args):
    if event.startswith(_PROCESSES):
        what = "network access" if event.startswith("socket.") else "this operation"
        raise PermissionError(f"{what} is not allowed in the sandbox ({event})")
    if event == "open":
        path, mode, flags = (tuple(args) + (None, None))[:3]
        writing = (isinstance(mode, str) and any(c in mode for c in "wax+")) or (isinstance(flags, int) and flags & _WRITE)
        if writing and path is not None and not isinstance(path, int) and not _inside(path):
            raise PermissionError(f"writing outside the sandbox's directory is not allowed ({path})")
    elif event in _PATHS:
        for path in args:
            if isinstance(path, (str, bytes, os.PathLike)) and not _inside(path):
                raise PermissionError(f"{event} outside the sandbox's directory is not allowed ({path})")
sys.addaudithook(_hook)
del _hook
_code = sys.stdin.read()
sys.stdin = open(os.devnull)
exec(compile(_code, "<tool>", "exec"), {"__name__": "__main__"})
"""

_NPROC = 32  # processes (threads count too) one call may have at once
_DISK_MB = 64  # each of its tmpfs (/tmp, /sandbox); also the largest file
_UID_BASE = 1 << 30  # uids of sandboxes when the trainer is root: above any real user's or subuid range
_UIDS = itertools.count()
_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


class SandboxUnavailable(RuntimeError):
    """Bubblewrap is missing or cannot create the sandbox's namespaces on this machine."""


class Python(Tool):
    """Run Python code; its result is what it prints (stdout, then stderr) and, if not 0, its exit code.

    Args:
        timeout_s: Wall-clock seconds per call; past them the whole sandbox is killed.
        memory_mb: Address-space limit of each process.
        max_output_chars: Output kept, half from the start and half from the end (the cut says how much).
        unsafe: Run without bubblewrap, fenced only by an audit hook and resource limits, which code written
            to escape gets around (reads any file, reaches the network). For machines where bubblewrap
            cannot run, with code you trust.
    """

    name = "python"
    description = "Run Python 3 code in a sandbox and return what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 2000,
                 unsafe: bool = False) -> None:  # fmt: skip
        super().__init__(timeout_s)
        if memory_mb < 64:
            raise ValueError(f"tool python: `memory_mb` must be >= 64, got {memory_mb}.")
        if max_output_chars < 1:
            raise ValueError(f"tool python: `max_output_chars` must be >= 1, got {max_output_chars}.")
        self.memory_mb, self.max_output_chars, self.unsafe = memory_mb, max_output_chars, unsafe
        if unsafe:
            warnings.warn(
                "tool python: `unsafe: true`: the model's code runs without bubblewrap, fenced only by "
                "an audit hook that code written to escape removes (any file, the network).",
                stacklevel=2,
            )
        else:
            check_sandbox()

    def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
        out, code = run_sandboxed(arguments["code"], timeout_s, self.memory_mb, unsafe=self.unsafe)
        if len(out) > self.max_output_chars:  # the start and the end (where a traceback's error is)
            head, tail = self.max_output_chars - self.max_output_chars // 2, self.max_output_chars // 2
            out = f"{out[:head]}\n[{len(out) - head - tail} characters cut]\n{out[len(out) - tail :] if tail else ''}"
        return out if code == 0 else f"{out}\n[exit code {code}]".lstrip("\n")


def check_sandbox() -> None:
    """Raise :class:`SandboxUnavailable`, naming what is missing and the fix, unless bubblewrap can run a
    sandbox here (tried once per process)."""
    bwrap = shutil.which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "tool python: the sandbox needs bubblewrap (`bwrap`), which is not on PATH. Install it "
            "(`apt-get install bubblewrap`, which scripts/install.sh does when run as root), or set `unsafe: true` "
            "on the tool to run the model's code without it (not safe against code written to escape)."
        )
    _probe(bwrap)


@functools.cache  # a failure raises, so only a working bwrap is remembered
def _probe(bwrap: str) -> None:
    try:
        out, code = _run_bwrap(bwrap, "print('ok')", 30.0, 256)
    except ToolError as err:
        out, code = str(err), -1
    if (out, code) != ("ok\n", 0):
        raise SandboxUnavailable(
            f"tool python: bubblewrap ({bwrap}) could not start a sandbox (exit code {code}): {out.strip()[-500:]}. "
            "It needs unprivileged user namespaces (`sysctl -w user.max_user_namespaces=15000`, and "
            "`kernel.unprivileged_userns_clone=1` or `kernel.apparmor_restrict_unprivileged_userns=0` where "
            "those exist; in a container, one that allows them). Or set `unsafe: true` on the tool to run the "
            "model's code without it (not safe against code written to escape)."
        )


def run_sandboxed(code: str, timeout_s: float, memory_mb: int = 1024, *, unsafe: bool = False) -> tuple[str, int]:
    """Run ``code`` as described above; returns (stdout + stderr, exit code). Raises :class:`ToolError`
    past ``timeout_s`` (the sandbox killed) and :class:`SandboxUnavailable` if bubblewrap cannot run (unless
    ``unsafe``: then the weaker fence)."""
    if unsafe:
        return _run_unsafe(code, timeout_s, memory_mb)
    check_sandbox()
    return _run_bwrap(shutil.which("bwrap") or "bwrap", code, timeout_s, memory_mb)


def _run_bwrap(bwrap: str, code: str, timeout_s: float, memory_mb: int) -> tuple[str, int]:
    real = os.path.realpath(getattr(sys, "_base_executable", None) or sys.executable)
    prefix = os.path.realpath(sys.base_prefix)
    python = [real, "-I", "-S", "-B", "-c",
              f"import resource; resource.setrlimit(resource.RLIMIT_NPROC, ({_NPROC}, {_NPROC}))\n{_BOOT}"]  # fmt: skip
    uid = _UID_BASE + os.getpid() % (1 << 22) * 64 + next(_UIDS) % 64 if os.geteuid() == 0 else None
    if uid is None:  # a user namespace of its own, as this user (who can read the interpreter's prefix)
        args = [bwrap, "--unshare-all", "--unshare-user", "--disable-userns"]
    else:
        # Root: bwrap mounts (the prefix may lie under /root, which an unprivileged uid cannot traverse) and
        # setpriv drops to the call's own uid, every capability and privilege gone, before the interpreter.
        args = [bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts", "--unshare-cgroup-try"]
        python = [shutil.which("setpriv") or "setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups",
                  "--inh-caps=-all", "--bounding-set=-all", "--no-new-privs", *python]  # fmt: skip
    args += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv", "--setenv", "PATH",
             "/usr/bin:/bin", "--setenv", "HOME", "/sandbox", "--setenv", "TMPDIR", "/tmp", "--setenv", "LANG",
             "C.UTF-8", "--ro-bind", "/usr", "/usr"]  # fmt: skip
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):  # merged-/usr links, or real folders
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    # The prefix at its own path (absolute rpaths), the folders above it made traversable.
    if os.path.commonpath([prefix, "/usr"]) != "/usr":
        above = [os.path.dirname(prefix)]
        while above[-1] != "/":
            above.append(os.path.dirname(above[-1]))
        args += [x for folder in reversed(above[:-1]) for x in ("--perms", "0755", "--dir", folder)]
        args += ["--ro-bind", prefix, prefix]
    size = str(_DISK_MB << 20)
    args += ["--proc", "/proc", "--dev", "/dev", "--size", size, "--perms", "1777", "--tmpfs", "/tmp", "--size", size,
             "--perms", "1777", "--tmpfs", "/sandbox", "--chdir", "/sandbox", "--", *python]  # fmt: skip
    cpu = max(1, int(timeout_s) + 1)

    def limits() -> None:  # in the child, before exec: system calls only
        _common_limits(memory_mb, cpu)
        if uid is not None:  # the call's own uid: its count on the host is this sandbox's alone
            resource.setrlimit(resource.RLIMIT_NPROC, (_NPROC + 2, _NPROC + 2))

    fds = []
    if _SECCOMP:
        fds = list(os.pipe())
        os.write(fds[1], _SECCOMP)  # 13 instructions: far under a pipe's buffer
        os.close(fds.pop())
        args[1:1] = ["--seccomp", str(fds[0])]
    try:
        proc = subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True,
            pass_fds=fds, preexec_fn=limits,
        )  # fmt: skip
    finally:
        for fd in fds:
            os.close(fd)
    return _communicate(proc, code, timeout_s)


def _seccomp_filter() -> bytes | None:
    """A seccomp program refusing new user namespaces (``unshare``/``clone`` with ``CLONE_NEWUSER``; ``clone3``,
    whose flags it cannot read, answers ENOSYS so the C library falls back to ``clone``) and any other system
    call ABI (i386, x32), where those numbers differ. Root's sandboxes need it: without a user namespace of
    their own, bwrap's ``--disable-userns`` does not apply. None on machines other than x86_64 and aarch64."""
    arch = {"x86_64": (0xC000003E, 272, 56), "aarch64": (0xC00000B7, 97, 220)}.get(platform.machine())
    if arch is None:
        return None
    audit_arch, unshare, clone = arch
    eperm, enosys, allow = 0x00050000 | 1, 0x00050000 | 38, 0x7FFF0000
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    program = [
        (ld, 0, 0, 4), (jeq, 1, 0, audit_arch), (ret, 0, 0, eperm),  # 0-2: the arch
        (ld, 0, 0, 0), (jge, 6, 0, 0x40000000), (jeq, 6, 0, 435),  # 3-5: the number; x32; clone3
        (jeq, 1, 0, unshare), (jeq, 0, 2, clone),  # 6-7
        (ld, 0, 0, 16), (jset, 1, 0, _CLONE_NEWUSER),  # 8-9: the flags (args[0], low half)
        (ret, 0, 0, allow), (ret, 0, 0, eperm), (ret, 0, 0, enosys),  # 10-12
    ]  # fmt: skip
    return b"".join(struct.pack("=HBBI", *op) for op in program)


def _run_unsafe(code: str, timeout_s: float, memory_mb: int) -> tuple[str, int]:
    """The weaker fence: the audit hook and limits, in a temporary folder of the host."""
    folder = tempfile.mkdtemp(prefix="yatt-sandbox-")
    env = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    cpu = max(1, int(timeout_s) + 1)
    libc = _libc()

    def limits() -> None:  # in the child, before exec: system calls only
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)  # no network where the kernel allows it; else the hook
        _common_limits(memory_mb, cpu)
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))  # root is exempt

    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT], cwd=folder, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limits,
        )  # fmt: skip
        return _communicate(proc, code, timeout_s)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _common_limits(memory_mb: int, cpu: int) -> None:
    resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
    resource.setrlimit(resource.RLIMIT_FSIZE, (_DISK_MB << 20, _DISK_MB << 20))
    resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))


def _communicate(proc: subprocess.Popen, code: str, timeout_s: float) -> tuple[str, int]:
    try:
        out, _ = proc.communicate(code.encode(), timeout=timeout_s)
    except subprocess.TimeoutExpired:
        # bwrap's group; its init in the sandbox dies with it (--die-with-parent), and with the init every
        # process of the pid namespace.
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate()
        raise ToolError(f"python did not finish within {timeout_s:g} s (killed)") from None
    return out.decode(errors="replace"), proc.returncode


def _libc():
    """The C library's handle, taken in the parent (a forked child must not import: another thread may have
    held the import lock at the fork)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_LIBC = None
_SECCOMP = _seccomp_filter()
