"""Loaded by ``bench/soak.py --diagnose DIR`` into the relay's processes (``PYTHONPATH``): on SIGUSR2
each process writes what its memory is made of to ``DIR/<pid>-<n>.json`` — RSS split into
anonymous and file-backed, the C heap in use (glibc ``mallinfo2``), what SQLite has allocated
(``sqlite3_status64``: its page caches), Python's allocated blocks, the 40 most numerous object types,
the entries of the project's containers (``Class.attribute``: caches, tables, queues), the asyncio
tasks, and with
``PYTHONTRACEMALLOC`` set the 40 biggest allocation sites; once ``DIR/trim`` exists it then calls
``malloc_trim(0)`` and records its RSS again (what giving free heap memory back returns). Not part
of the relay."""

from __future__ import annotations

import ctypes
import gc
import json
import os
import signal
import sys
from collections import Counter
from typing import Any

DIR = os.environ.get("SOAK_DIAGNOSE_DIR")


class _MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks",
                 "keepcost")]


def _mallinfo() -> dict[str, int]:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = _MallInfo2
        info = libc.mallinfo2()
        return {"heap_in_use": info.uordblks + info.hblkhd, "heap_free": info.fordblks, "mmapped": info.hblkhd}
    except (OSError, AttributeError):
        return {}


def _sqlite_memory() -> dict[str, int]:
    """Bytes SQLite has allocated in this process (its page caches, mostly)."""
    try:
        lib = ctypes.CDLL("libsqlite3.so.0")
        cur, high = ctypes.c_int64(), ctypes.c_int64()
        if lib.sqlite3_status64(0, ctypes.byref(cur), ctypes.byref(high), 0) == 0:  # SQLITE_STATUS_MEMORY_USED
            return {"sqlite_memory": cur.value}
    except (OSError, AttributeError):
        pass
    return {}


def _rss() -> dict[str, int]:
    out: dict[str, int] = {}
    with open("/proc/self/status") as fh:
        for line in fh:
            if line.startswith(("VmRSS", "RssAnon", "RssFile", "RssShmem")):
                key, value = line.split(":")
                out[key] = int(value.split()[0]) * 1024
    return out


_OURS = ("relay.", "firehose.", "backfill.", "mst.", "prometheus_client.")


def _containers() -> dict[str, int]:
    """Entries held by each container attribute (dict, set, list, deque, …) of the project's own
    objects (and the metrics library's), summed per ``Class.attribute``: the caches, tables and
    queues, whichever of them grows."""
    out: Counter[str] = Counter()
    for obj in gc.get_objects():
        cls = type(obj)
        if not (cls.__module__ or "").startswith(_OURS):
            continue
        try:
            attrs = vars(obj).items() if hasattr(obj, "__dict__") else (
                (n, getattr(obj, n, None)) for c in cls.__mro__ for n in getattr(c, "__slots__", ()))
            for name, value in attrs:
                if isinstance(value, (dict, set, list, frozenset)) or type(value).__name__ in ("deque", "OrderedDict"):
                    out[f"{cls.__name__}.{name}"] += len(value)
        except Exception:  # noqa: BLE001 - a diagnostic: skip what cannot be looked at
            continue
    return {k: v for k, v in out.most_common(60) if v >= 100}


def _dump(*_: Any) -> None:
    """The signal handler: never raises (an exception here would surface inside whatever the
    process was doing — a worker's read, a timer callback of the event loop — and break it)."""
    try:
        _write_dump()
    except Exception as exc:  # noqa: BLE001 - a diagnostic must not disturb the process it looks at
        print(f"soak diagnose: dump failed in {os.getpid()}: {exc!r}", file=sys.stderr)


def _write_dump() -> None:
    global _n
    _n += 1
    doc: dict[str, Any] = {"pid": os.getpid(), "argv": sys.argv[:3], **_rss(), **_mallinfo(), **_sqlite_memory(),
                           "py_blocks": sys.getallocatedblocks()}
    doc["gc_collected"] = gc.collect()  # count what is alive, not cyclic garbage awaiting a full collection
    counts = Counter(type(o).__name__ for o in gc.get_objects())
    doc["types"] = dict(counts.most_common(40))
    for name in ("mst._native_node", "mst._node"):  # the compiled build, else the Python one
        node = sys.modules.get(name)
        if node is not None and hasattr(node, "_HEIGHTS"):
            doc["mst_key_heights_cached"] = len(node._HEIGHTS)
            break
    crypto = sys.modules.get("mst.crypto")
    if crypto is not None:
        doc["did_keys_cached"] = len(crypto.KEYS)
    doc["containers"] = _containers()
    tasks = getattr(sys.modules.get("asyncio.tasks"), "_all_tasks", None)
    if tasks is not None:
        doc["asyncio_tasks"] = len(tasks)
    import tracemalloc

    if tracemalloc.is_tracing():
        snap = tracemalloc.take_snapshot()
        doc["traced"] = tracemalloc.get_traced_memory()[0]
        doc["sites"] = [(str(s.traceback), s.size, s.count) for s in snap.statistics("lineno")[:40]]
    if os.path.exists(os.path.join(DIR or ".", "trim")):  # what giving free heap memory back returns
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
            doc["VmRSS_after_trim"] = _rss()["VmRSS"]
        except (OSError, AttributeError):
            pass
    with open(os.path.join(DIR or ".", f"{os.getpid()}-{_n}.json"), "w") as fh:
        json.dump(doc, fh)


_n = 0
if DIR:
    signal.signal(signal.SIGUSR2, _dump)
