"""The ``python`` tool's sandbox against code written to escape it.

Most tests first remove the in-process audit hook (``_UNHOOK``: the rebinding of ``__main__`` that got around
the old fence), so what they check is the bubblewrap layer alone: files, network, processes, other episodes
and resources. Each escape must fail on what it reads or where its writes land, not merely raise nothing.
"""

from __future__ import annotations

import os
import shutil
import socket
import tempfile
import threading
import time
import uuid
from pathlib import Path

import pytest

from yatt_lightning.agents import sandbox
from yatt_lightning.agents.sandbox import Python, SandboxUnavailable, run_sandboxed
from yatt_lightning.agents.tools import ToolError

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap (apt-get install bubblewrap)")

# What got around the old fence: the audit hook's globals live in __main__ and can be rebound.
_UNHOOK = "import __main__; __main__._PROCESSES = (); __main__._inside = lambda p: True\n"
_SECRET = "s3cret-" + uuid.uuid4().hex


def _run(code: str, timeout_s: float = 10.0, memory_mb: int = 256) -> tuple[str, int]:
    return run_sandboxed(_UNHOOK + code, timeout_s, memory_mb)


def _host_files(tmp_path: Path) -> list[Path]:
    """A run's data, a checkpoint and a cache entry, outside the sandbox."""
    files = [tmp_path / "run" / "data.jsonl", tmp_path / "checkpoints" / "step-1" / "model.safetensors",
             tmp_path / "home" / ".cache" / "huggingface" / "token"]  # fmt: skip
    for file in files:
        file.parent.mkdir(parents=True, exist_ok=True)
        file.write_text(_SECRET)
    return files


def test_ordinary_code_runs_and_reports_its_exit_code():
    py = Python(timeout_s=5.0)
    code = "import json, math\nopen('a.json', 'w').write(json.dumps({'x': math.sqrt(16)}))\nprint(json.load(open('a.json')))"
    assert py.run({"code": code}, {}, 5.0) == "{'x': 4.0}\n"
    assert py.run({"code": "import sys; print('bye'); sys.exit(3)"}, {}, 5.0) == "bye\n\n[exit code 3]"


def test_removing_the_hook_works_so_the_other_tests_check_the_namespaces():
    out, code = _run(
        "import subprocess; print(subprocess.run(['sh', '-c', 'echo spawned'], capture_output=True).stdout)"
    )
    assert (out, code) == ("b'spawned\\n'\n", 0)


def test_host_files_are_not_there_to_read(tmp_path: Path):
    cache = Path(os.path.expanduser("~/.cache"))
    cache.mkdir(parents=True, exist_ok=True)
    real_cache = tempfile.NamedTemporaryFile("w", dir=cache, prefix="yatt-sandbox-test-", delete=False)
    real_cache.write(_SECRET)
    real_cache.close()
    paths = [*map(str, _host_files(tmp_path)), real_cache.name, "/etc/passwd", "/etc/shadow", __file__]
    code = f"""
import ctypes, os, subprocess
libc = ctypes.CDLL(None, use_errno=True)
for path in {paths!r}:
    for read in (lambda p: open(p).read(), lambda p: os.listdir(os.path.dirname(p)),
                 lambda p: subprocess.run(['cat', p], capture_output=True, check=True).stdout.decode()):
        try:
            print('LEAK', path, read(path))
        except Exception as err:
            print('refused', type(err).__name__)
    print('libc.open', libc.open(path.encode(), 0))
print('home', os.listdir(os.path.expanduser('~')), 'root', sorted(os.listdir('/')))
"""
    try:
        out, code = _run(code)
    finally:
        os.unlink(real_cache.name)
    assert code == 0, out
    assert "LEAK" not in out and _SECRET not in out and "root:" not in out
    assert out.count("refused") == 3 * len(paths) and out.count("libc.open -1") == len(paths)
    assert "home []" in out and "'etc'" not in out and "'work'" not in out and "'home'" not in out


def test_writes_do_not_reach_the_host(tmp_path: Path):
    name = f"yatt-escape-{uuid.uuid4().hex}"
    target = tmp_path / "out" / name
    target.parent.mkdir()
    code = f"""
import os, subprocess
attempts = {{
    'chdir': lambda: (os.chdir('/tmp'), open({name!r}, 'w').write('x'), os.chdir('/sandbox')),
    'dir_fd': lambda: os.write(os.open('tmp/{name}.fd', os.O_CREAT | os.O_WRONLY, dir_fd=os.open('/', os.O_RDONLY)), b'x'),
    'symlink': lambda: (os.symlink({str(target)!r}, 'link'), open('link', 'w').write('x')),
    'dotdot': lambda: open('../../..' + {str(target)!r}, 'w').write('x'),
    'makedirs': lambda: (os.makedirs({str(target.parent)!r}, exist_ok=True), open({str(target)!r}, 'w').write('x')),
    'shell': lambda: subprocess.run(['sh', '-c', 'echo x > {target}.sh; echo x > /tmp/{name}.sh'], check=True),
}}
for what, attempt in attempts.items():
    try:
        attempt()
        print(what, 'wrote inside')
    except Exception as err:
        print(what, 'refused', type(err).__name__)
"""
    out, code = _run(code)
    assert code == 0 and out.count("\n") == 6, out
    landed = [
        p
        for p in (
            target,
            Path(f"{target}.sh"),
            Path("/tmp", name),
            Path("/tmp", f"{name}.fd"),
            Path("/tmp", f"{name}.sh"),
            tmp_path / "link",
        )  # fmt: skip
        if p.exists()
    ]
    assert landed == [] and os.listdir(target.parent) == []


def test_ctypes_system_calls_do_not_reach_the_host(tmp_path: Path):
    secret = _host_files(tmp_path)[0]
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
os.mkdir('m')
print('mount', libc.mount(b'/', b'm', None, 0x1000 | 0x4000, None))  # MS_BIND | MS_REC
print('chroot', libc.chroot(b'/'), 'setuid', libc.setuid(0))
print('unshare', libc.unshare(0x10000000 | 0x20000))  # a user and a mount namespace of its own
print('mount after unshare', libc.mount(b'/', b'm', None, 0x1000 | 0x4000, None), os.listdir('m'))
print('open', libc.open({str(secret).encode()!r}, 0), libc.open(b'/etc/passwd', 0))
"""
    out, code = _run(code)
    assert "mount -1" in out and "setuid -1" in out and "unshare -1" in out and "open -1 -1" in out, out
    assert _SECRET not in out and "'etc'" not in out and "'work'" not in out


class _Listener:
    """A TCP server in this process that counts the connections it gets."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port, self.accepted = self.sock.getsockname()[1], 0
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.accepted += 1
            conn.sendall(b"reached")
            conn.close()


def test_no_host_port_and_no_name_is_reachable():
    server = _Listener()
    code = f"""
import socket, urllib.request
for host in ('127.0.0.1', 'localhost', '::1'):
    try:
        print('CONNECTED', host, socket.create_connection((host, {server.port}), timeout=2).recv(10))
    except OSError as err:
        print('refused', host, type(err).__name__)
for what in (lambda: socket.getaddrinfo('example.com', 80), lambda: urllib.request.urlopen('http://example.com', timeout=2)):
    try:
        print('RESOLVED', what())
    except OSError as err:
        print('refused', type(err).__name__)
"""
    try:
        out, code = _run(code)
    finally:
        server.sock.close()
    assert code == 0 and out.count("refused") == 5, out
    assert "CONNECTED" not in out and "RESOLVED" not in out and "reached" not in out and server.accepted == 0


def _sandbox_processes() -> list[str]:
    """Processes on the host under this process's sandbox uids (as root, each call has its own)."""
    first = sandbox._UID_BASE + os.getpid() % (1 << 22) * 64
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/status") as f:
                uid = int(next(line.split()[1] for line in f if line.startswith("Uid:")))
        except (OSError, StopIteration):
            continue
        if first <= uid < first + 64:
            found.append(pid)
    return found


def test_a_fork_bomb_is_bounded_and_the_next_call_works():
    count = """
import os, time
n = 0
try:
    while n < 1000:
        if os.fork() == 0:
            time.sleep(30)
            os._exit(0)
        n += 1
except OSError as err:
    print('stopped at', n, type(err).__name__)
"""
    t0 = time.monotonic()
    out, _ = _run(count)
    assert out.startswith("stopped at") and 0 < int(out.split()[2]) < 32, out
    assert time.monotonic() - t0 < 10  # its sleeping children died with it
    t0 = time.monotonic()
    with pytest.raises(ToolError, match="did not finish within 2 s"):
        _run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass", timeout_s=2.0)
    assert time.monotonic() - t0 < 10
    assert _run("print('after')") == ("after\n", 0)
    if os.geteuid() == 0:
        deadline = time.monotonic() + 5
        while _sandbox_processes() and time.monotonic() < deadline:
            time.sleep(0.1)
        assert _sandbox_processes() == []


def test_memory_and_disk_are_bounded():
    out, code = _run("b = bytearray(1 << 30)", memory_mb=256)
    assert code == 1 and "MemoryError" in out
    fill = """
chunk, total = b'x' * (1 << 20), 0
for name in ('/tmp/a', '/tmp/b', 'c', 'd'):
    try:
        with open(name, 'wb') as f:
            for _ in range(48):
                f.write(chunk)
                total += 1
    except OSError as err:
        print(name, type(err).__name__)
print('wrote', total)
"""
    out, code = _run(fill)
    assert code == 0 and "/tmp/b OSError" in out and "d OSError" in out, out
    assert int(out.split()[-1]) <= 2 * 64


def test_an_infinite_loop_is_killed_and_the_next_call_works():
    py = Python(timeout_s=1.0)
    t0 = time.monotonic()
    with pytest.raises(ToolError, match="did not finish within 1 s"):
        py.run({"code": _UNHOOK + "import subprocess; subprocess.Popen(['sleep', '60'])\nwhile True: pass"}, {}, 1.0)
    assert time.monotonic() - t0 < 6
    assert py.run({"code": "print(1)"}, {}, 5.0) == "1\n"


def test_an_episode_cannot_read_another_episodes_files():
    first: list = []
    writer = threading.Thread(target=lambda: first.append(_run(
        f"open('answer.txt', 'w').write({_SECRET!r}); open('/tmp/answer.txt', 'w').write({_SECRET!r})\n"
        f"import time; time.sleep(3); print(open('answer.txt').read())", timeout_s=10.0)))  # fmt: skip
    writer.start()
    time.sleep(1.0)
    search = """
import glob, os
seen = []
for pattern in ('/proc/*/cwd/*', '/proc/*/root/tmp/*', '/proc/*/root/sandbox/*', '/tmp/*', '/sandbox/*',
                '/tmp/yatt-sandbox-*/*', '/*/answer.txt', '/proc/*/environ'):
    for path in glob.glob(pattern):
        try:
            seen.append(open(path, errors='replace').read())
        except OSError:
            pass
print('pids', sorted(p for p in os.listdir('/proc') if p.isdigit()))
print('\\n'.join(seen))
"""
    out, code = _run(search)
    writer.join()
    assert code == 0 and _SECRET not in out, out
    assert first == [(_SECRET + "\n", 0)]  # the writer ran beside it, and kept its own file


def test_without_bubblewrap_the_tool_refuses_to_start_unless_unsafe(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(SandboxUnavailable, match=r"bubblewrap.*apt-get install bubblewrap.*`unsafe: true`"):
        Python()
    with pytest.warns(UserWarning, match="unsafe: true"):
        py = Python(unsafe=True)
    assert py.run({"code": "print(6 * 7)"}, {}, 5.0) == "42\n"
    fake = tmp_path / "bwrap"  # a bwrap that cannot create namespaces
    fake.write_text("#!/bin/sh\necho 'bwrap: No permissions to create a new namespace' >&2\nexit 1\n")
    fake.chmod(0o755)
    with pytest.raises(SandboxUnavailable, match=r"No permissions to create a new namespace.*user namespaces.*unsafe"):
        Python()
