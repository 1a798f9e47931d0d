"""The named semaphores of the local backend, unlinked even when the launching process is killed with SIGKILL.

torch's elastic agent starts the ranks with multiprocessing's spawn context and hands them a
SimpleQueue per rank and one Event: nine POSIX semaphores for two ranks, files /dev/shm/sem.mp-*.
Under spawn they keep their names while in use, and Python's resource tracker (a helper process)
unlinks them once every process holding them is gone. That helper starts in the launching
process's group, so `kill -9 -PGID` (a job scheduler, a terminal's hang-up) took it down with the
agent and the files stayed behind. Here the tracker starts in a session of its own before the agent
creates any semaphore: a SIGKILL of the group leaves it running; the ranks die with the launching
process (local_agent.die_with_parent), the tracker's pipe closes, and it unlinks the nine names.
"""

from __future__ import annotations

import os
import subprocess
from multiprocessing import resource_tracker, spawn, util
from typing import Any

_tracker: list[subprocess.Popen[Any]] = []
"""The detached tracker's process handle, kept so that it is never garbage-collected while it runs."""


def detach_resource_tracker() -> bool:
    """Start multiprocessing's resource tracker in its own session unless one runs; whether this one did."""
    tracker = resource_tracker._resource_tracker
    lock = getattr(tracker, "_lock", None)
    if lock is None or not hasattr(tracker, "_fd") or not hasattr(tracker, "_pid"):
        return False  # another Python's tracker: its own start stays (the files may outlive a SIGKILL)
    with lock:
        if tracker._fd is not None:
            return False
        read, write = os.pipe()
        try:
            command = f"from multiprocessing.resource_tracker import main;main({read})"
            process = subprocess.Popen(
                [spawn.get_executable(), *util._args_from_interpreter_flags(), "-c", command],
                pass_fds=(read,),
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,  # its "leaked semaphore" note after a SIGKILL tells a user nothing
                start_new_session=True,
            )
        except OSError:
            os.close(write)
            return False
        finally:
            os.close(read)
        tracker._fd, tracker._pid = write, process.pid
        _tracker.append(process)
    return True
