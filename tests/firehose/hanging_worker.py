"""A validation worker (``firehose.worker_main``) that hangs forever on any batch holding the slow
frame, like a pathological input would; used as ``WorkerPool.module`` by the pipeline tests."""

from __future__ import annotations

import sys
import time

import firehose.pipeline as pipeline
from firehose import worker_main

SLOW = b"\xfe" * 10
_validate = pipeline.validate_batch


def _validate_or_hang(jobs):  # type: ignore[no-untyped-def]
    if any(job[0] == SLOW for job in jobs):
        time.sleep(3600)
    return _validate(jobs)


pipeline.validate_batch = _validate_or_hang  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(worker_main.main())
