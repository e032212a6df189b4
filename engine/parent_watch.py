"""Children that leave with their parent.

`loragate serve --instances N` starts its engines, and the default model's adapter trainer,
as child processes. Ctrl-C reaches them all (one process group) and a normal stop terminates
them, but a gateway killed outright (SIGKILL, the OOM killer, a crash) would leave them
running: engines holding a model's memory and their ports, a trainer holding both CPUs, and a
restart loop adding a set each time. So the parent names itself in PARENT_ENV and each child
watches for being reparented, which is how the OS tells a child its parent is gone.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Mapping

log = logging.getLogger(__name__)

PARENT_ENV = "LORAGATE_PARENT_PID"
"""Set by a parent on its children's environment: its own pid."""

CHECK_EVERY_S = 1.0
GRACE_S = 30.0
"""After SIGTERM (the child's own graceful stop), how long before the watch exits hard."""


def child_env(env: Mapping[str, str]) -> dict[str, str]:
    """A copy of env for a child that must not outlive this process."""
    return {**env, PARENT_ENV: str(os.getpid())}


def exit_with_parent(check_every_s: float = CHECK_EVERY_S, grace_s: float = GRACE_S
                     ) -> threading.Thread | None:
    """When PARENT_ENV names a parent, watch (daemon thread) for this process being orphaned;
    then stop it as SIGTERM would (an engine drains through its usual handler), and exit
    outright if that has not ended it within grace_s. None when no parent is named (an engine
    started by hand, or by a supervisor that manages it)."""
    # Taken out of the environment: it names this process's parent, not its children's.
    value = os.environ.pop(PARENT_ENV, None)
    if not value:
        return None
    parent = int(value)

    def watch() -> None:
        # A parent that died before this check has already left the child to another parent.
        while os.getppid() == parent:
            time.sleep(check_every_s)
        log.warning("parent process %d is gone: stopping", parent)
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(grace_s)
        os._exit(1)

    thread = threading.Thread(target=watch, name="parent-watch", daemon=True)
    thread.start()
    return thread
