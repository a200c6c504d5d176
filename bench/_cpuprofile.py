"""Run a module under cProfile timed by the calling thread's CPU clock (``time.thread_time``).

    python bench/_cpuprofile.py OUT -m MODULE [ARGS...]

A wall-clock profile on a loaded machine charges every preemption to whatever line was running
(a pipe write that wakes a worker, a thread hand-off): CPU time charges only the work itself.
Only the main thread is profiled; the stats are written to ``OUT`` on exit (also on SIGTERM).
With ``RELAY_PROFILE_ON_SIGNAL=1`` profiling starts only at SIGUSR1, so a bench can profile just its
measured window (start-up, crawling and warm-up left out).
"""

from __future__ import annotations

import cProfile
import os
import runpy
import signal
import sys
import time
from pathlib import Path


def main() -> None:
    out, flag, module, *args = sys.argv[1:]
    if flag != "-m":
        raise SystemExit(__doc__)
    sys.argv = [module, *args]
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # the repository, not bench/
    prof = cProfile.Profile(time.thread_time)

    def _term(signum: int, frame: object) -> None:
        raise SystemExit(0)

    signal.signal(signal.SIGTERM, _term)
    if os.environ.get("RELAY_PROFILE_ON_SIGNAL") == "1":
        signal.signal(signal.SIGUSR1, lambda signum, frame: prof.enable())
    else:
        prof.enable()
    try:
        runpy.run_module(module, run_name="__main__", alter_sys=True)
    finally:
        prof.disable()
        prof.dump_stats(out)


if __name__ == "__main__":
    main()
