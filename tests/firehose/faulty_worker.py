"""A validation worker (``firehose.worker_main``) that misbehaves on two marker frames, as a crash in
native code or a pathological input would: it dies abruptly on any batch holding ``POISON`` and
hangs forever on any batch holding ``SLOW``. Used as ``WorkerPool.module`` by the pipeline tests."""

from __future__ import annotations

import os
import sys
import time

import firehose.pipeline as pipeline
from firehose import worker_main

POISON = b"\xff" * 10
SLOW = b"\xfe" * 10
_validate = pipeline.validate_batch


def _validate_or_misbehave(jobs):  # type: ignore[no-untyped-def]
    frames = {job[0] for job in jobs}
    if POISON in frames:
        os._exit(70)
    if SLOW in frames:
        time.sleep(3600)
    return _validate(jobs)


pipeline.validate_batch = _validate_or_misbehave  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(worker_main.main())
