"""The ``python`` tool: the model's code in a separate process, fenced.

Each call gets a fresh interpreter (``python -I``: no user site, no environment variables read) in a fresh
temporary directory (its working directory and home, removed afterwards), with:

- a wall-clock timeout: past it the call's whole process group is killed (``start_new_session``), so
  nothing it started outlives it;
- resource limits (``setrlimit``): address space (``memory_mb``), CPU seconds, file size, open files, and
  no child processes;
- no network: a new network namespace where the kernel allows one (unprivileged user namespaces), and in
  every case an audit hook (:pep:`578`, installed before the code runs and impossible to remove from
  Python) that refuses sockets, writes outside the directory, new processes and ``ctypes``;
- output (stdout and stderr) cut to ``max_output_chars`` (its start and its end, where an error is).

This fences code a policy writes by chance or by reward hacking, not an adversary with native code: run
untrusted workloads in a container or a VM as well.
"""

from __future__ import annotations

import contextlib
import os
import resource
import shutil
import signal
import subprocess
import sys
import tempfile

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

_CLONE_NEWUSER, _CLONE_NEWNET = 0x10000000, 0x40000000


class Python(Tool):
    """Run Python code; its result is what it prints (stdout, then stderr) and, if not 0, its exit code.

    Args:
        timeout_s: Wall-clock seconds per call; past them the process group is killed.
        memory_mb: Address-space limit of the process.
        max_output_chars: Output kept, half from the start and half from the end (the cut says how much).
    """

    name = "python"
    description = "Run Python 3 code in a sandbox and return what it prints."
    parameters = {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}

    def __init__(self, timeout_s: float = 10.0, memory_mb: int = 1024, max_output_chars: int = 2000) -> None:
        super().__init__(timeout_s)
        if memory_mb < 64:
            raise ValueError(f"tool python: `memory_mb` must be >= 64, got {memory_mb}.")
        if max_output_chars < 1:
            raise ValueError(f"tool python: `max_output_chars` must be >= 1, got {max_output_chars}.")
        self.memory_mb, self.max_output_chars = memory_mb, max_output_chars

    def run(self, arguments: dict, row: dict, timeout_s: float) -> str:
        out, code = run_sandboxed(arguments["code"], timeout_s, self.memory_mb)
        if len(out) > self.max_output_chars:  # the start and the end (where a traceback's error is)
            head, tail = self.max_output_chars - self.max_output_chars // 2, self.max_output_chars // 2
            out = f"{out[:head]}\n[{len(out) - head - tail} characters cut]\n{out[len(out) - tail:] if tail else ''}"
        return out if code == 0 else f"{out}\n[exit code {code}]".lstrip("\n")


def run_sandboxed(code: str, timeout_s: float, memory_mb: int = 1024) -> tuple[str, int]:
    """Run ``code`` as described above; returns (stdout + stderr, exit code). Raises :class:`ToolError`
    past ``timeout_s`` (the process group killed)."""
    folder = tempfile.mkdtemp(prefix="yatt-sandbox-")
    env = {"PATH": os.defpath, "HOME": folder, "TMPDIR": folder, "PYTHONDONTWRITEBYTECODE": "1", "LANG": "C.UTF-8"}
    cpu = max(1, int(timeout_s) + 1)

    libc = _libc()

    def limits() -> None:  # in the child, before exec: system calls only
        # A network namespace of its own (no interface but a down loopback) where the kernel lets an
        # unprivileged process have one; otherwise the audit hook alone refuses sockets.
        libc.unshare(_CLONE_NEWUSER | _CLONE_NEWNET)
        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu))
        resource.setrlimit(resource.RLIMIT_FSIZE, (64 << 20, 64 << 20))
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, 64))
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NPROC, (0, 0))

    try:
        proc = subprocess.Popen(
            [sys.executable, "-I", "-c", _BOOT], cwd=folder, env=env, stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True, preexec_fn=limits,
        )  # fmt: skip
        try:
            out, _ = proc.communicate(code.encode(), timeout=timeout_s)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise ToolError(f"python did not finish within {timeout_s:g} s (killed)") from None
        return out.decode(errors="replace"), proc.returncode
    finally:
        shutil.rmtree(folder, ignore_errors=True)


def _libc():
    """The C library's handle, taken in the parent (a forked child must not import: another thread may have
    held the import lock at the fork)."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        _LIBC = ctypes.CDLL(None, use_errno=True)
    return _LIBC


_LIBC = None
