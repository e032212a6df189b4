"""Children started with child_env stop once their parent is gone, however it went (the
demo-adapter trainer relies on this as the engines do; tests/test_serve_lifecycle_live.py kills
a real gateway under its engine)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from engine.parent_watch import PARENT_ENV, child_env, exit_with_parent

ROOT = Path(__file__).resolve().parents[1]

CHILD = """
import time
from engine.parent_watch import exit_with_parent
assert exit_with_parent(check_every_s=0.1, grace_s=5) is not None
print("watching", flush=True)
time.sleep(60)
"""
# A parent that starts the child with child_env, says its pid, then waits to be killed.
PARENT = """
import os, subprocess, sys, time
from engine.parent_watch import child_env
child = subprocess.Popen([sys.executable, "-c", sys.argv[1]], stdout=subprocess.PIPE,
                         text=True, env=child_env(os.environ))
assert child.stdout.readline().strip() == "watching"
print(child.pid, flush=True)
time.sleep(60)
"""


def alive(pid: int) -> bool:
    """Running and not a zombie (an orphan's reaper may be slow to collect it)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads /proc")
def test_a_child_stops_when_its_parent_is_killed() -> None:
    parent = subprocess.Popen([sys.executable, "-c", PARENT, CHILD], cwd=ROOT,
                              stdout=subprocess.PIPE, text=True)
    assert parent.stdout is not None
    child = int(parent.stdout.readline())
    try:
        time.sleep(0.5)
        assert alive(child)  # the watch leaves a child of a living parent alone
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 20
        while alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not alive(child)
    finally:
        if parent.poll() is None:
            parent.kill()
        if alive(child):
            os.kill(child, signal.SIGKILL)


def test_child_env_names_this_process_and_no_parent_means_no_watch(
        monkeypatch: pytest.MonkeyPatch) -> None:
    assert child_env({"A": "1"}) == {"A": "1", PARENT_ENV: str(os.getpid())}
    monkeypatch.delenv(PARENT_ENV, raising=False)
    assert exit_with_parent() is None  # an engine started by hand watches nothing
