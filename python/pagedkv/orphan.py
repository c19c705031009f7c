"""Processes that leave when the process that started them is gone.

A server, router or worker started by another pagedkv process runs in its own process group
(so it can be stopped as a group), which also means nothing stops it when its starter dies
without cleaning up (SIGKILL, a crashed test run): it would keep its port and memory forever.
Linux's ``PR_SET_PDEATHSIG`` is no answer here, since it fires when the starting *thread*
ends, and a restart thread may start a server. So the child polls its parent's pid instead:
once it is re-parented (``os.getppid()`` changes), it acts.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable

__all__ = ["PARENT_PID_ENV", "leave_when_orphaned", "watch_parent_from_env"]

logger = logging.getLogger(__name__)

# Set by pagedkv.server.launch.ServerProcess for the `pagedkv serve|router` it starts.
PARENT_PID_ENV = "PAGEDKV_PARENT_PID"
# How often (seconds) the parent's pid is checked: cheap, and a leftover lives at most this long.
POLL_SECONDS = 1.0


def leave_when_orphaned(parent_pid: int, leave: Callable[[], None], what: str) -> threading.Thread:
    """Starts a daemon thread that calls ``leave()`` once this process's parent is no longer
    ``parent_pid`` (at once if it already is not)."""

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(POLL_SECONDS)
        logger.warning("%s: the process that started it (pid %d) is gone; leaving", what, parent_pid)
        leave()

    thread = threading.Thread(target=watch, name="pagedkv-parent-watch", daemon=True)
    thread.start()
    return thread


def watch_parent_from_env(what: str) -> None:
    """If :data:`PARENT_PID_ENV` is set, shut this process down gracefully (SIGTERM to itself:
    a server stops accepting, finishes or ends its streams, and stops what it started) when
    that parent is gone. The variable is removed, so this process's own children do not
    inherit a pid that is not their parent's."""
    raw = os.environ.pop(PARENT_PID_ENV, None)
    if raw is None:
        return
    try:
        parent_pid = int(raw)
    except ValueError:
        logger.warning("ignoring %s=%r (not a pid)", PARENT_PID_ENV, raw)
        return
    leave_when_orphaned(parent_pid, lambda: os.kill(os.getpid(), signal.SIGTERM), what)
