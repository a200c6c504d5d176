"""Entry point of one validation worker process (see ``firehose.workers``): reads batches of
wire jobs from stdin, answers each with ``firehose.pipeline.validate_batch`` on stdout, and exits
when stdin closes. Between batches it gives freed heap memory back to the operating system
(``firehose.memtrim``: checked at most every 5 s, a trim once the RSS stands 32 MiB above its lowest with
32 MiB of it resident free memory, as in the main process)."""

from __future__ import annotations

import contextlib
import os
import pickle
import signal
import sys


def main() -> int:
    # Ctrl-C in the relay's terminal, and SIGTERM to the relay's process group (systemd's default
    # KillMode, `kill -- -PGID`), reach every worker too: the parent decides when workers stop (by
    # closing their stdin, once it has shut down gracefully), so a half-finished batch is never
    # cut off and the pool never sees its workers die while it shuts down. A worker is still
    # stopped at once by SIGKILL, and by its parent's death (stdin closes).
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    from firehose.memtrim import glibc_trimmer
    from firehose.pipeline import validate_batch  # imports (and warms) everything validation needs

    trimmer = glibc_trimmer()

    inp = sys.stdin.buffer
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must never corrupt the result stream
    try:
        out.write(bytes(4))  # ready
        out.flush()
        while True:
            head = inp.read(4)
            if len(head) < 4:
                return 0
            size = int.from_bytes(head, "big")
            data = inp.read(size)
            if len(data) < size:
                return 0
            result = pickle.dumps(validate_batch(pickle.loads(data)), protocol=5)
            out.write(len(result).to_bytes(4, "big"))
            out.write(result)
            out.flush()
            del data, result
            if trimmer is not None:
                trimmer.tick()
    except BrokenPipeError:  # the parent is gone: nobody to answer, nothing to report
        return 0
    finally:
        with contextlib.suppress(OSError):  # no "Exception ignored … BrokenPipeError" at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())


if __name__ == "__main__":
    sys.exit(main())
