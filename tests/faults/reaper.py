"""``python reaper.py PIDFILE CMD [ARG...]``: run CMD as a child and reap every process it leaves.

The fault suite kills servers with SIGKILL. Their own children (PostgreSQL backends, the relay's
validation workers) are then orphans, and in a container whose PID 1 does not reap, every orphan
would stay behind as a zombie. This process makes itself a *child subreaper* (Linux
``PR_SET_CHILD_SUBREAPER``), so orphans of CMD's tree are re-parented to it and reaped here.

Contract: CMD's pid is written to PIDFILE (then renamed into place, so a reader never sees a
partial file) before CMD is executed; SIGINT/SIGTERM/SIGQUIT received here are forwarded to CMD;
the reaper exits once no descendant is left, with CMD's exit status (128 + signal number when CMD
was killed by a signal). Without ``prctl`` (not Linux) it still runs CMD and reaps what it can.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

PR_SET_CHILD_SUBREAPER = 36


def main(argv: list[str]) -> int:
    if len(argv) < 2:
        print("usage: reaper.py PIDFILE CMD [ARG...]", file=sys.stderr)
        return 2
    pidfile, cmd = argv[0], argv[1:]
    try:
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    except (OSError, AttributeError):
        pass
    child = os.fork()
    if child == 0:
        try:
            os.execvp(cmd[0], cmd)
        finally:
            os._exit(127)
    tmp = f"{pidfile}.tmp"
    with open(tmp, "w") as fh:
        fh.write(f"{child}\n")
    os.replace(tmp, pidfile)

    def forward(signum: int, _frame: object) -> None:
        try:
            os.kill(child, signum)
        except ProcessLookupError:
            pass

    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGQUIT):
        signal.signal(sig, forward)
    status = 0
    while True:
        try:
            pid, raw = os.waitpid(-1, 0)
        except ChildProcessError:
            return status
        except InterruptedError:  # pragma: no cover - PEP 475 retries; kept for clarity
            continue
        if pid == child:
            status = 128 + os.WTERMSIG(raw) if os.WIFSIGNALED(raw) else os.WEXITSTATUS(raw)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
