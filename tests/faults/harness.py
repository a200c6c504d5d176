"""Processes for the fault-injection suite: a private PostgreSQL cluster, a private Redis and the
relay itself, each a child process on a free 127.0.0.1 port that a test can kill, stop and restart.

Contracts:

* Nothing here touches the machine's shared PostgreSQL (5432) or Redis (6379): every server is
  started from its own binary into its own temporary directory, on its own port.
* Every server runs under ``reaper.py`` (a child subreaper: whatever a killed server orphans is
  reaped, no zombies). Every class is an async context manager; leaving it (also on error or
  cancellation) ends every process it started (``SIGKILL`` at the latest) and removes its
  directory; ``close()`` is idempotent. Should that cleanup not run (a timeout, an interrupted
  event loop), :func:`kill_leftovers` (the suite's fixture finalizer, and ``atexit``) ends them.
  Processes are only ever signalled by their own id: the server, the children it has, its reaper,
  and for the relay whatever of its own session still runs ``relay.cli`` or a validation worker.
* PostgreSQL refuses to run as root. When the suite runs as root, the cluster runs as an
  unprivileged system user (:data:`PG_USER`, created with ``useradd --system`` if missing) that owns
  the cluster's directory; otherwise it runs as the current user.
* ``start()`` returns once the server accepts connections (the relay: once ``/_health`` answers
  200), or raises ``RuntimeError`` with the end of the server's log.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import glob
import json
import os
import pwd
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Self

import asyncpg
import httpx
import redis.asyncio as aioredis

ROOT = Path(__file__).resolve().parents[2]
#: The unprivileged account the private PostgreSQL runs as when we are root.
PG_USER = os.environ.get("RELAY_FAULTS_PG_USER", "relayfault")
#: Relay settings that pass through from our environment; every other ``RELAY_*`` is dropped.
PASS_THROUGH = ("RELAY_PURE_PYTHON",)
REAPER = Path(__file__).resolve().parent / "reaper.py"


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def log_tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a log file ("" if it does not exist)."""
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def log_summary(path: Path, limit: int = 12) -> str:
    """The relay's JSON log condensed: one line per distinct (level, logger, msg, last line of the
    exception) with how often it occurred, in order of first occurrence, the last ``limit`` of
    them; lines that are not JSON are kept as they are."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ""
    counts: dict[str, int] = {}
    for raw in text.splitlines():
        try:
            rec = json.loads(raw)
        except ValueError:
            key = raw[:300]
        else:
            if not isinstance(rec, dict):
                continue
            exc = str(rec.get("exc") or "").strip().splitlines()
            key = f"{rec.get('level')} {rec.get('logger')}: {rec.get('msg')}" + (f" [{exc[-1][:200]}]" if exc else "")
        counts[key] = counts.get(key, 0) + 1
    return "\n".join(f"{n}x {key}" for key, n in list(counts.items())[-limit:])


def pg_bin_dir() -> Path:
    """The newest ``/usr/lib/postgresql/<version>/bin`` holding ``initdb`` (``RELAY_FAULTS_PG_BIN``
    overrides it)."""
    override = os.environ.get("RELAY_FAULTS_PG_BIN")
    if override:
        return Path(override)
    found = sorted(glob.glob("/usr/lib/postgresql/*/bin/initdb"),
                   key=lambda p: int(Path(p).parent.parent.name) if Path(p).parent.parent.name.isdigit() else 0)
    if found:
        return Path(found[-1]).parent
    which = shutil.which("initdb")
    if which:
        return Path(which).parent
    raise RuntimeError("PostgreSQL server binaries (initdb, postgres) not found under /usr/lib/postgresql")


def ensure_system_user(name: str = PG_USER) -> pwd.struct_passwd:
    """The account ``name``, created as a system user without a home if it does not exist yet."""
    try:
        return pwd.getpwnam(name)
    except KeyError:
        pass
    shell = "/usr/sbin/nologin" if os.path.exists("/usr/sbin/nologin") else "/bin/false"
    done = subprocess.run(["useradd", "--system", "--no-create-home", "--shell", shell, name],
                          capture_output=True, text=True, check=False)
    try:  # a concurrent run may have created it between our look-up and useradd
        return pwd.getpwnam(name)
    except KeyError:
        raise RuntimeError(f"cannot create system user {name!r}: {done.stderr.strip()}") from None


def _state(pid: int) -> str | None:
    """The process state letter from /proc (``None`` if there is no such process)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().decode(errors="replace").rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return None


def alive(pid: int) -> bool:
    """Whether ``pid`` is a running process (a zombie is not: it only waits to be reaped)."""
    state = _state(pid)
    return state is not None and state not in ("Z", "X")


def _proc_stats() -> Iterator[tuple[int, list[str]]]:
    """``(pid, fields)`` for every process in /proc: the fields of ``/proc/PID/stat`` after the
    command name (``fields[0]`` state, ``[1]`` parent pid, ``[3]`` session id)."""
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/stat", "rb") as fh:
                fields = fh.read().decode(errors="replace").rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        yield int(d), fields


def children_of(pid: int) -> list[int]:
    """Direct children of ``pid`` (from /proc)."""
    return [child for child, fields in _proc_stats() if fields[1:2] == [str(pid)]]


def session_members(sids: set[int]) -> list[int]:
    """Running processes whose session id is in ``sids`` and which run this project's Python
    (``relay.cli``, ``tests.faults.faulty_relay`` or a validation worker): what is left of relays started with their own session."""
    found: list[int] = []
    for pid, fields in _proc_stats():
        try:
            if int(fields[3]) not in sids or fields[0] in ("Z", "X"):
                continue
            with open(f"/proc/{pid}/cmdline", "rb") as fh:
                cmdline = fh.read()
        except (OSError, IndexError, ValueError):
            continue
        if b"relay.cli" in cmdline or b"faulty_relay" in cmdline or b"firehose.worker_main" in cmdline:
            found.append(pid)
    return found


async def wait_gone(pids: list[int], timeout: float = 10.0) -> bool:
    """Wait until none of ``pids`` runs any more; False if some still run after ``timeout``."""
    deadline = time.monotonic() + timeout
    while any(alive(p) for p in pids):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


async def _wait_exit(proc: subprocess.Popen[bytes], timeout: float) -> bool:
    """Reap ``proc`` within ``timeout`` seconds (without blocking the event loop)."""
    deadline = time.monotonic() + timeout
    while proc.poll() is None:
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


#: Every supervised process started and not yet seen finished, and every directory not yet removed:
#: what :func:`kill_leftovers` ends when a test's own cleanup could not run (e.g. a timeout).
_LIVE: set[Supervised] = set()
_DIRS: set[Path] = set()


def make_dir(prefix: str) -> Path:
    """A new temporary directory that :func:`kill_leftovers` removes if nobody else does."""
    path = Path(tempfile.mkdtemp(prefix=prefix))
    _DIRS.add(path)
    return path


def remove_dir(path: Path) -> None:
    """Remove a directory from :func:`make_dir` (whatever it holds)."""
    shutil.rmtree(path, ignore_errors=True)
    _DIRS.discard(path)


def kill_leftovers() -> int:
    """Synchronously SIGKILL every process this module started that still runs (with its children
    and its reaper) and remove every directory it made; returns how many processes it had to end.
    The suite's fixture finalizer calls it after each test, and it runs at interpreter exit."""
    ended = 0
    for sup in list(_LIVE):
        if sup.kill_now():
            ended += 1
    for path in list(_DIRS):
        remove_dir(path)
    return ended


atexit.register(kill_leftovers)


class _Managed:
    """Shared async-context-manager plumbing: ``close()`` on exit, whatever happened."""

    async def close(self) -> None:  # pragma: no cover - overridden
        raise NotImplementedError

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                        tb: TracebackType | None) -> None:
        await self.close()


class Supervised:
    """A command run under ``reaper.py`` (which reaps whatever the command's tree orphans).

    ``pid`` is the command's own pid (e.g. the postmaster), ``reaper`` the child process we
    started; the reaper exits once the command and every descendant are gone, so ``finished``
    means "nothing of it runs any more".
    """

    def __init__(self, cmd: list[str], *, cwd: Path, env: dict[str, str], log_path: Path, pidfile: Path,
                 new_session: bool = False) -> None:
        with contextlib.suppress(FileNotFoundError):
            pidfile.unlink()
        self.pidfile = pidfile
        with log_path.open("ab") as log:
            self.reaper = subprocess.Popen([sys.executable, str(REAPER), str(pidfile), *cmd], cwd=cwd, env=env,
                                           stdin=subprocess.DEVNULL, stdout=log, stderr=log,
                                           start_new_session=new_session)
        self._pid: int | None = None
        _LIVE.add(self)

    async def wait_pid(self, timeout: float = 10.0) -> int:
        """The command's pid, once the reaper has forked it."""
        deadline = time.monotonic() + timeout
        while self._pid is None:
            with contextlib.suppress(FileNotFoundError, ValueError):
                self._pid = int(self.pidfile.read_text())
                break
            if self.reaper.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"{self.pidfile.name}: command did not start")
            await asyncio.sleep(0.01)
        return self._pid

    @property
    def pid(self) -> int:
        if self._pid is None:
            raise RuntimeError("command not started yet (await wait_pid())")
        return self._pid

    @property
    def finished(self) -> bool:
        """True once the reaper exited: the command and all its descendants are gone."""
        if self.reaper.poll() is None:
            return False
        _LIVE.discard(self)
        return True

    def kill_now(self) -> bool:
        """Synchronous last resort (finalizers, exit): SIGKILL the command, its children and the
        reaper, and reap the reaper. Returns False if everything had finished already."""
        if self.finished:
            return False
        pid = self._pid
        if pid is None:
            with contextlib.suppress(OSError, ValueError):
                pid = int(self.pidfile.read_text())
        victims = [pid, *children_of(pid)] if pid is not None else []
        for victim in [*victims, self.reaper.pid]:
            if alive(victim):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(victim, signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.reaper.wait(5)
        _LIVE.discard(self)
        return True

    @property
    def running(self) -> bool:
        """The command itself (not only leftovers of its tree) still runs."""
        return not self.finished and self._pid is not None and alive(self._pid)

    @property
    def returncode(self) -> int | None:
        """The command's exit status (128 + signal when killed), once everything finished."""
        return self.reaper.poll()

    def signal(self, sig: int) -> None:
        """Send ``sig`` to the command (not to the reaper)."""
        if self._pid is not None and not self.finished:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self._pid, sig)

    async def wait(self, timeout: float) -> bool:
        """Wait until everything finished; False on timeout."""
        return await _wait_exit(self.reaper, timeout)

    async def kill_all(self) -> None:
        """Last resort: SIGKILL the command, its children and the reaper."""
        victims = [self._pid, *children_of(self._pid)] if self._pid is not None else []
        for pid in [*victims, self.reaper.pid]:
            if pid is not None and alive(pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
        await _wait_exit(self.reaper, 10)
        _ = self.finished  # unregisters


class PgCluster(_Managed):
    """A private PostgreSQL cluster: ``initdb`` into a temporary directory, the postmaster run as our
    child (under ``reaper.py``) on a free port, trust authentication, database ``postgres``.

    ``kill9()`` SIGKILLs the postmaster and all its children (a crash: shared memory and the lock
    file are left behind, and the next ``start()`` runs crash recovery); ``stop()`` is a fast
    shutdown (``pg_ctl stop -m fast``: SIGINT to the postmaster); ``restart_fast()`` is stop then
    start. The data directory and the port stay the same across restarts.

    Durability settings: ``fsync=off`` and ``full_page_writes=off`` spare the shared disk; they only
    matter for an operating-system crash. Against a killed *process* a committed transaction is
    as durable as with the defaults, because ``synchronous_commit`` stays on (the WAL is written to
    the kernel before the commit is acknowledged, and the kernel keeps it when the process dies).
    """

    def __init__(self, *, port: int | None = None) -> None:
        self.base = make_dir("relay-faults-pg-")
        self.data = self.base / "data"
        self.log_path = self.base / "postgres.log"
        self.port = port or free_port()
        self.bin = pg_bin_dir()
        self.server: Supervised | None = None
        self._prefix: list[str] = []
        self._initialised = False
        self._closed = False

    @property
    def dsn(self) -> str:
        """``postgresql://postgres@127.0.0.1:PORT/postgres``."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def running(self) -> bool:
        """The postmaster runs."""
        return self.server is not None and self.server.running

    def _as_user(self) -> list[str]:
        """Command prefix that drops root privileges (empty when we are not root)."""
        if os.geteuid() != 0:
            return []
        user = ensure_system_user()
        os.chown(self.base, user.pw_uid, user.pw_gid)
        os.chmod(self.base, 0o700)
        if shutil.which("setpriv"):
            return ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--init-groups", "--"]
        return ["runuser", "-u", user.pw_name, "--"]

    def _env(self) -> dict[str, str]:
        keep = {k: v for k, v in os.environ.items() if k in ("PATH", "TZ")}
        return {**keep, "LC_ALL": "C", "LANG": "C", "HOME": str(self.base)}

    async def _initdb(self) -> None:
        self._prefix = self._as_user()
        cmd = [*self._prefix, str(self.bin / "initdb"), "-D", str(self.data), "-A", "trust", "-U", "postgres",
               "-E", "UTF8", "--locale=C", "--no-sync", "--no-instructions"]
        with self.log_path.open("ab") as log:
            proc = await asyncio.create_subprocess_exec(*cmd, cwd=self.base, env=self._env(),
                                                        stdout=log, stderr=log)
            rc = await proc.wait()
        if rc != 0:
            raise RuntimeError(f"initdb failed ({rc}):\n{log_tail(self.log_path)}")
        with (self.data / "postgresql.conf").open("a") as conf:
            conf.write(
                "\n# relay fault-injection suite\n"
                "listen_addresses = '127.0.0.1'\n"
                f"port = {self.port}\n"
                f"unix_socket_directories = '{self.base}'\n"
                "fsync = off\nfull_page_writes = off\nsynchronous_commit = on\n"
                "shared_buffers = 16MB\nmax_connections = 60\n"
                "max_wal_size = 256MB\nlog_min_messages = warning\n")
        self._initialised = True

    async def start(self, timeout: float = 60.0) -> None:
        """(Create the cluster the first time, then) start the postmaster and wait until it accepts
        connections (after crash recovery, if it was killed)."""
        if self.running:
            return
        if not self._initialised:
            await self._initdb()
        self.server = Supervised([*self._prefix, str(self.bin / "postgres"), "-D", str(self.data)],
                                 cwd=self.base, env=self._env(), log_path=self.log_path,
                                 pidfile=self.base / "postmaster.reaper.pid")
        await self.server.wait_pid()
        deadline = time.monotonic() + timeout
        while True:
            if self.server.finished:
                raise RuntimeError(f"postgres exited ({self.server.returncode}):\n{log_tail(self.log_path)}")
            try:
                conn = await asyncpg.connect(self.dsn, timeout=2)
                try:
                    await conn.fetchval("SELECT 1")
                finally:
                    await conn.close()
                return
            except (OSError, asyncpg.PostgresError, asyncpg.InterfaceError, TimeoutError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"postgres not ready after {timeout} s:\n{log_tail(self.log_path)}")
            await asyncio.sleep(0.05)

    async def kill9(self) -> None:
        """SIGKILL the postmaster and every child it has, and wait until all of them are gone."""
        server = self.server
        if server is None or server.finished:
            return
        for pid in [server.pid, *children_of(server.pid)]:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        if not await server.wait(10):
            await server.kill_all()

    async def stop(self, mode: str = "fast", timeout: float = 30.0) -> None:
        """Shut down like ``pg_ctl stop -m MODE`` (``smart``: SIGTERM, ``fast``: SIGINT,
        ``immediate``: SIGQUIT) and wait until every process is gone; SIGKILL after ``timeout``."""
        server = self.server
        if server is None or server.finished:
            return
        server.signal({"smart": signal.SIGTERM, "fast": signal.SIGINT, "immediate": signal.SIGQUIT}[mode])
        if not await server.wait(timeout):
            await self.kill9()

    async def restart_fast(self) -> None:
        """``pg_ctl restart -m fast``: fast shutdown, then start on the same directory and port."""
        await self.stop("fast")
        await self.start()

    async def close(self) -> None:
        """Stop the cluster (immediate shutdown, SIGKILL as the last resort) and remove its files."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stop("immediate", timeout=10)
        finally:
            if self.server is not None and not self.server.finished:
                await self.server.kill_all()
            remove_dir(self.base)


class RedisServer(_Managed):
    """A private ``redis-server`` (no persistence: ``--save '' --appendonly no``) on a free port,
    run under ``reaper.py``. ``kill9()`` loses every key; ``start()`` again listens on the same
    port, empty."""

    def __init__(self, *, port: int | None = None) -> None:
        self.port = port or free_port()
        self.base = make_dir("relay-faults-redis-")
        self.log_path = self.base / "redis.log"
        self.server: Supervised | None = None
        self._closed = False

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def running(self) -> bool:
        return self.server is not None and self.server.running

    async def start(self, timeout: float = 30.0) -> None:
        """Start the server and wait until it answers PING."""
        if self.running:
            return
        binary = shutil.which("redis-server") or "/usr/bin/redis-server"
        self.server = Supervised(
            [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.base), "--daemonize", "no", "--protected-mode", "no", "--loglevel", "warning"],
            cwd=self.base, env=dict(os.environ), log_path=self.log_path, pidfile=self.base / "redis.reaper.pid")
        await self.server.wait_pid()
        deadline = time.monotonic() + timeout
        while True:
            if self.server.finished:
                raise RuntimeError(f"redis-server exited ({self.server.returncode}):\n{log_tail(self.log_path)}")
            client = aioredis.from_url(self.url, socket_connect_timeout=1, socket_timeout=1)
            try:
                if await client.ping():
                    return
            except (OSError, aioredis.RedisError):
                pass
            finally:
                await client.aclose()
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server not ready after {timeout} s:\n{log_tail(self.log_path)}")
            await asyncio.sleep(0.05)

    def pause(self) -> None:
        """SIGSTOP: the server keeps its connections open and answers nothing (a hung Redis)."""
        if self.server is not None and not self.server.finished:
            self.server.signal(signal.SIGSTOP)

    def resume(self) -> None:
        """SIGCONT after ``pause``."""
        if self.server is not None and not self.server.finished:
            self.server.signal(signal.SIGCONT)

    async def last_entry_seq(self, stream: str = "relay:events") -> int:
        """The seq of the newest entry of the bus stream (entry IDs are ``<seq>-0``; 0 when empty)."""
        client = aioredis.from_url(self.url, socket_connect_timeout=2, socket_timeout=2)
        try:
            entries = await client.xrevrange(stream, count=1)
        finally:
            await client.aclose()
        return int(entries[0][0].decode().split("-")[0]) if entries else 0

    async def kill9(self) -> None:
        """SIGKILL the server and wait until it is gone."""
        server = self.server
        if server is not None and not server.finished:
            server.signal(signal.SIGKILL)
            if not await server.wait(10):
                await server.kill_all()

    async def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        try:
            await self.kill9()
        finally:
            remove_dir(self.base)


class RelayProcess(_Managed):
    """``relay serve|ingest|fanout`` as a child process (under ``reaper.py``, in its own session),
    listening on a fixed free port that survives restarts.

    ``settings`` are ``RELAY_*`` environment variables; ``RELAY_BIND`` and ``RELAY_LOG_LEVEL``
    (``warning``) are set here; other ``RELAY_*`` variables of our environment are not passed on.
    The log (JSON lines on stderr) is appended to ``log_path``.
    """

    def __init__(self, role: str, settings: dict[str, str], log_path: Path, *, port: int | None = None) -> None:
        self.role = role
        self.port = port or free_port()
        self.log_path = log_path
        self.settings = {"RELAY_LOG_LEVEL": "warning", **settings, "RELAY_BIND": f"127.0.0.1:{self.port}"}
        #: the command line to start instead of ``relay <role>`` (a faulty relay: ``tests.faults.faulty_relay``)
        self.command: list[str] | None = None
        self.server: Supervised | None = None
        self._sessions: set[int] = set()
        self._closed = False

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def ws_url(self) -> str:
        """The ``subscribeRepos`` endpoint."""
        return f"ws://127.0.0.1:{self.port}/xrpc/com.atproto.sync.subscribeRepos"

    @property
    def alive(self) -> bool:
        """The relay's main process runs."""
        return self.server is not None and self.server.running

    def _env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if not k.startswith("RELAY_") or k in PASS_THROUGH}
        return {**env, **self.settings}

    async def start(self, timeout: float = 90.0, state: str = "running", may_exit: bool = False) -> float:
        """Start the process and wait until ``/_health`` answers 200 with ``state`` (the port opens
        while the service is still ``starting``; an ingest waiting for the writer lease is
        ``standby``); returns that moment (``time.monotonic()``). ``may_exit``: a process that ends
        before it answers (a fault hook made it exit) is not an error; returns when it ended."""
        if self.alive:
            raise RuntimeError(f"relay {self.role} already running")
        self.server = Supervised(self.command or [sys.executable, "-m", "relay.cli", self.role], cwd=ROOT, env=self._env(),
                                 log_path=self.log_path, pidfile=self.log_path.with_suffix(".pid"),
                                 new_session=True)
        self._sessions.add(self.server.reaper.pid)
        await self.server.wait_pid()
        deadline = time.monotonic() + timeout
        async with httpx.AsyncClient(timeout=2) as http:
            while True:
                if not self.server.running:
                    if may_exit:
                        return time.monotonic()
                    raise RuntimeError(f"relay {self.role} exited:\n{log_tail(self.log_path)}")
                with contextlib.suppress(httpx.HTTPError, ValueError):
                    resp = await http.get(self.url + "/_health")
                    if resp.status_code == 200 and resp.json().get("state") == state:
                        return time.monotonic()
                if time.monotonic() > deadline:
                    raise RuntimeError(f"relay {self.role} not {state} after {timeout} s:\n{log_tail(self.log_path)}")
                await asyncio.sleep(0.1)

    async def kill9(self) -> None:
        """SIGKILL the relay's main process; its validation workers see their pipe close and exit
        (and are reaped), which this waits for."""
        server = self.server
        if server is not None and not server.finished:
            server.signal(signal.SIGKILL)
            if not await server.wait(15):
                await server.kill_all()

    async def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (graceful), SIGKILL after ``timeout``."""
        server = self.server
        if server is not None and not server.finished:
            server.signal(signal.SIGTERM)
            if not await server.wait(timeout):
                await self.kill9()

    async def close(self) -> None:
        """Stop the relay and end whatever is left of every session it ever ran in."""
        if self._closed:
            return
        self._closed = True
        try:
            await self.stop()
        finally:
            if self.server is not None and not self.server.finished:
                await self.server.kill_all()
            for pid in session_members(self._sessions):
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.kill(pid, signal.SIGKILL)
