"""Entry point of one validation worker process (see ``firehose.workers``): reads batches of
wire jobs from stdin, answers each with ``firehose.pipeline.validate_batch`` on stdout, and exits
when stdin closes."""

from __future__ import annotations

import pickle
import signal
import sys


def main() -> int:
    # Ctrl-C in the relay's terminal reaches the whole process group: the parent decides when
    # workers stop (by closing their stdin), so a half-finished batch is never cut off.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    from firehose.pipeline import validate_batch  # imports (and warms) everything validation needs

    inp = sys.stdin.buffer
    out = sys.stdout.buffer
    sys.stdout = sys.stderr  # a stray print must never corrupt the result stream
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


if __name__ == "__main__":
    sys.exit(main())
