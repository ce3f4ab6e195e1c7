"""Helper processes that end with the process that started them.

A worker of a process pool reads its next task from a pipe; a parent killed with SIGKILL cannot tell it
to stop, and a worker in the middle of a long task lives on under PID 1 with its memory. On Linux the
kernel can send it a signal when its parent dies (prctl PR_SET_PDEATHSIG); a parent that died before
the call is caught by comparing the parent's pid. Elsewhere nothing is done.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1  # linux/prctl.h


def end_with_parent(parent_pid: int) -> None:
    """Called in a child process: SIGKILL it when `parent_pid`, its parent, dies (now, if it already has)."""
    if not sys.platform.startswith("linux"):
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) != 0:
        return  # not allowed here (a seccomp filter): the pool's own shutdown is all there is
    if os.getppid() != parent_pid:  # the parent died before the signal was asked for
        os.kill(os.getpid(), signal.SIGKILL)
