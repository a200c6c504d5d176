"""A validation worker (``firehose.worker_main``) that dies abruptly, like a crash in native code,
on any batch holding the poison frame; used as ``WorkerPool.module`` by the pipeline tests."""

from __future__ import annotations

import os
import sys

import firehose.pipeline as pipeline
from firehose import worker_main

POISON = b"\xff" * 10
_validate = pipeline.validate_batch


def _validate_or_die(jobs):  # type: ignore[no-untyped-def]
    if any(job[0] == POISON for job in jobs):
        os._exit(70)
    return _validate(jobs)


pipeline.validate_batch = _validate_or_die  # type: ignore[assignment]

if __name__ == "__main__":
    sys.exit(worker_main.main())
