"""Validation worker processes, fed through pipes that the event loop reads and writes itself.

``WorkerPool(size)`` runs ``size`` child interpreters (``python -m firehose.worker_main``). A batch
goes to the child with the fewest batches outstanding as one length-prefixed pickle on its stdin;
its answers come back, in order, the same way on its stdout. Unlike ``ProcessPoolExecutor`` there is
no feeder thread, no manager thread and no cross-thread future: the parent's only costs per batch
are one ``pickle.dumps``, one pipe write, one pipe read and one ``pickle.loads`` on the loop thread.

A child that dies (crash, OOM killer, an operator's ``kill``) fails its outstanding batches with
:class:`WorkerDied` and is replaced at once (``restarts`` counts replacements). A batch not
answered within ``batch_timeout`` seconds of being sent (a frame that makes validation hang) gets
its worker killed, with the same outcome (``timeouts`` counts these). Children exit by
themselves when their stdin closes, so they never outlive the parent. Their stderr is the parent's.
They ignore SIGINT and SIGTERM: a signal to the whole process group (Ctrl-C, systemd, ``kill --
-PGID``) stops the parent, which closes the pool (:meth:`WorkerPool.close`, after which nothing is
respawned) and so its workers, each after the batch it is on.

Wire format, both directions: 4-byte big-endian length, then a pickle (protocol 5). Parent →
child: the batch (a list). Child → parent: the batch's result; an empty message (length 0) once
at start says the child has imported everything and is ready.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import pickle
import sys
from collections import deque
from collections.abc import Callable
from typing import Any

from firehose.backoff import Backoff

log = logging.getLogger(__name__)

__all__ = ["WorkerDied", "WorkerPool"]

_HEADER = 4


class WorkerDied(Exception):
    """The worker process running a batch exited before answering it."""


class _Worker:
    """One child process and the futures of its outstanding batches (answered in FIFO order)."""

    def __init__(self, proc: asyncio.subprocess.Process) -> None:
        self.proc = proc
        self.pending: deque[asyncio.Future[Any]] = deque()
        self.alive = True
        self.reader: asyncio.Task[None] | None = None

    async def read_results(self, on_exit: Callable[[_Worker], None]) -> None:
        """Resolve ``pending`` with each answer's bytes; at EOF fail them all and call ``on_exit``."""
        stdout = self.proc.stdout
        assert stdout is not None
        try:
            while True:
                head = await stdout.readexactly(_HEADER)
                size = int.from_bytes(head, "big")
                payload = await stdout.readexactly(size) if size else b""
                if not self.pending:
                    raise RuntimeError("worker answered a batch nobody sent")
                fut = self.pending.popleft()
                if not fut.done():
                    fut.set_result(payload)
        except (asyncio.IncompleteReadError, ConnectionError, RuntimeError) as exc:
            self.alive = False
            died = WorkerDied(f"worker {self.proc.pid} exited ({type(exc).__name__})")
            while self.pending:
                fut = self.pending.popleft()
                if not fut.done():
                    fut.set_exception(died)
            on_exit(self)


class WorkerPool:
    """See the module docstring. ``await start()`` before :meth:`run`; ``await close()`` at the end."""

    def __init__(self, size: int, module: str = "firehose.worker_main", *, batch_timeout: float = 30.0) -> None:
        if size < 1:
            raise ValueError("a worker pool needs at least one worker")
        self.size = size
        self.module = module
        self.batch_timeout = batch_timeout
        self.restarts = 0
        self.timeouts = 0
        self._workers: list[_Worker] = []
        self._closing = False
        self._changed = asyncio.Event()
        self._spawning: set[asyncio.Task[None]] = set()

    @property
    def pids(self) -> list[int]:
        return [w.proc.pid for w in self._workers if w.alive]

    async def start(self) -> None:
        await asyncio.gather(*(self._spawn() for _ in range(self.size)))

    async def _spawn(self) -> None:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", self.module,
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        )
        assert proc.stdout is not None
        try:
            ready = await asyncio.wait_for(proc.stdout.readexactly(_HEADER), 120)
        except (asyncio.IncompleteReadError, TimeoutError):
            proc.kill()
            await proc.wait()
            raise RuntimeError(f"validation worker failed to start (exit code {proc.returncode})") from None
        if ready != bytes(_HEADER):
            proc.kill()
            raise RuntimeError("validation worker sent an unexpected greeting")
        worker = _Worker(proc)
        if self._closing:
            await self._stop(worker)
            return
        worker.reader = asyncio.get_running_loop().create_task(worker.read_results(self._exited))
        self._workers.append(worker)
        self._changed.set()

    def _exited(self, worker: _Worker) -> None:
        with contextlib.suppress(ValueError):
            self._workers.remove(worker)
        if worker.proc.returncode is None:
            worker.proc.kill()  # it closed its stdout but lingers: make sure it is gone
        if self._closing:
            return
        self.restarts += 1
        log.warning("validation worker died; starting a new one", extra={"pid": worker.proc.pid})
        task = asyncio.get_running_loop().create_task(self._respawn())
        self._spawning.add(task)
        task.add_done_callback(self._spawning.discard)

    async def _respawn(self) -> None:
        backoff = Backoff(0.05, 5.0)
        while not self._closing:
            try:
                await self._spawn()
                return
            except (OSError, RuntimeError):
                log.exception("restarting a validation worker failed")
                await asyncio.sleep(backoff.next())

    async def run(self, batch: list[Any]) -> Any:
        """Send ``batch`` to the least busy worker and return its (unpickled) answer.
        Raises :class:`WorkerDied` if that worker exits first."""
        while True:
            live = [w for w in self._workers if w.alive and w.proc.returncode is None]
            if live:
                break
            if self._closing:
                raise WorkerDied("the worker pool is closed")
            self._changed.clear()
            await self._changed.wait()
        worker = min(live, key=lambda w: len(w.pending))
        payload = pickle.dumps(batch, protocol=5)
        fut: asyncio.Future[bytes] = asyncio.get_running_loop().create_future()
        worker.pending.append(fut)
        stdin = worker.proc.stdin
        assert stdin is not None
        try:
            # one write (one syscall, one wake-up of the worker) per batch, header included
            stdin.write(len(payload).to_bytes(_HEADER, "big") + payload)
            await stdin.drain()
        except (ConnectionError, RuntimeError):
            pass  # the reader sees the exit and fails ``fut`` with WorkerDied
        try:
            answer = await asyncio.wait_for(asyncio.shield(fut), self.batch_timeout)
        except TimeoutError:
            self.timeouts += 1
            log.warning("validation worker did not answer in time; killing it",
                        extra={"pid": worker.proc.pid, "timeout_s": self.batch_timeout})
            if worker.proc.returncode is None:
                worker.proc.kill()
            answer = await fut  # the reader fails it with WorkerDied once the process is gone
        return pickle.loads(answer)

    async def close(self) -> None:
        self._closing = True
        self._changed.set()
        for task in list(self._spawning):
            task.cancel()
        await asyncio.gather(*(self._stop(w) for w in list(self._workers)), return_exceptions=True)
        self._workers.clear()

    @staticmethod
    async def _stop(worker: _Worker) -> None:
        stdin = worker.proc.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.close()
        try:
            await asyncio.wait_for(worker.proc.wait(), 10)
        except TimeoutError:
            worker.proc.kill()
            await worker.proc.wait()
        if worker.reader is not None:
            worker.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await worker.reader
