"""The exit of a ``yatt`` process (``yatt_lightning/run/process_exit.py``): one collection, then a frozen heap.

Tier 1 (one plain interpreter, no torch): the handler is registered once however often it is asked for; the
garbage pending at exit is still finalized; the handlers that run after it find the heap frozen, so the
interpreter's own collections at exit have nothing to traverse.
"""

from __future__ import annotations

import sys

from tests.helpers import REPO, run

SCRIPT = """
import atexit, gc, sys
sys.path.insert(0, {repo!r})
from yatt_lightning.run import process_exit

atexit.register(lambda: print("after: frozen", gc.get_freeze_count(), "tracked", len(gc.get_objects()), flush=True))
before = atexit._ncallbacks()
for _ in range(3):
    process_exit.collect_once_at_exit()
print("registered", atexit._ncallbacks() - before, flush=True)


class Cycle:
    def __init__(self, path):
        self.me, self.path = self, path

    def __del__(self):
        with open(self.path, "w") as f:
            f.write("finalized")


Cycle({out!r})  # unreachable at once, but only a collection frees a cycle
gc.disable()  # no automatic collection before the exit's
"""


def test_the_exit_handler_is_registered_once_finalizes_pending_garbage_and_freezes_the_rest(tmp_path):
    out = tmp_path / "finalized.txt"
    script = tmp_path / "exit.py"
    script.write_text(SCRIPT.format(repo=str(REPO), out=str(out)))
    lines = run([sys.executable, str(script)], timeout=60).stdout.splitlines()
    assert lines[0] == "registered 1", lines
    frozen, tracked = int(lines[1].split()[2]), int(lines[1].split()[4])
    assert frozen > 1000 and tracked < 100, lines  # every object alive then is frozen: nothing left to traverse
    assert out.read_text() == "finalized"
