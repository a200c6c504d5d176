"""Fault modes a simulated host can inject, and the verdict a correct relay must reach for each.

``SimHost.set_fault(kind, rate)`` switches a mode on: ``rate`` is the probability per generated
commit (per emitted frame for the connection faults). Every event a host emits is recorded in
``SimFleet.ground_truth`` as a :class:`sim.fleet.TruthEvent` whose ``verdict`` says what the
relay should do with it (``accept``, ``reject``, ``desync`` or ``ignore``) and ``reason`` says why.

Frame-level faults (the frame itself is wrong):

* ``bad_signature`` – commit signed with a key that is not the account's → reject ``bad_signature``.
* ``broken_chain`` – a commit is withheld, so the next one's ``since``/``prevData`` do not chain
  to what the relay holds → the next commit is ``desync`` ``since_mismatch``.
* ``missing_block`` – the MST root node is stripped from the CAR slice → reject
  ``missing_mst_block`` (operation inversion cannot run).
* ``oversized`` – a frame over the 5 MB frame limit → reject ``frame_too_large``.
* ``duplicate`` – the same frame (same seq) is sent twice → second copy ``ignore``
  ``seq_not_increasing`` (the upstream subscriber drops it).
* ``replay`` – an old commit is sent again under a new seq → ``ignore`` ``rev_not_increasing``.
* ``seq_backwards`` – the host is wiped: log cleared, seq restarts at 1, connections dropped;
  the repositories are intact, later frames are valid (a relay reconnecting with its old cursor
  gets ``FutureCursor``).
* ``wipe_restore`` – the host is wiped and restored from a backup that predates each account's
  latest commit: as ``seq_backwards``, and every account on it (with more than its first commit)
  loses its latest commit. That account's next commit does not chain to what a relay holds →
  ``desync`` ``since_mismatch``; a resync then finds the repository the host serves now.
* ``unreadable`` – bytes that do not decode as a frame (a commit frame cut in the middle of its
  body; it takes a seq, so the next frame's seq is one higher) → reject ``bad_body_cbor``; every
  frame after it is read as usual. ``SimFleet.emit("unreadable", acct)`` puts one at a chosen
  position of a backlog.
* ``foreign_sync`` – a host that is not the account's PDS sends a ``#sync`` for it (signed with
  the account's real key, a newer rev; the account's repository is unchanged) → reject
  ``wrong_host``.

Connection faults (frames stay valid; only delivery misbehaves):

* ``slow`` – each affected frame is delayed by ``SimConfig.slow_delay`` seconds.
* ``stall`` – the host stops sending for ``SimConfig.stall_seconds`` while keeping the socket.
* ``disconnect`` – the TCP connection is aborted right after the affected frame.

``SimHost.drop_connections()`` aborts every current subscriber at once, on demand (the log is
kept, so a subscriber reconnecting with its cursor misses nothing); ``tests/faults`` uses it with
``disconnect`` for an upstream disconnect storm.

Account faults (valid events that change what the relay may redistribute):

* ``deactivate`` / ``takedown`` – ``#account active=false`` (status ``deactivated`` /
  ``takendown``); the account is reactivated by a later ``#account active=true``.
* ``key_rotation`` – new signing key, the PLC document is updated and ``#identity`` is emitted;
  later commits are signed with the new key.
* ``migration`` – the account moves to another host: PLC document updated, the new host emits
  ``#identity``, ``#account active`` and ``#sync``; the old host's ``#account`` deactivation is
  ``reject`` ``wrong_host`` (the DID document no longer names it).

Weather (valid events, slow or failing services around them; switched per account or host,
off by default; the delay distributions are ``sim.weather.Delay``: fixed, or a tail such
as p50 50 ms / p99 3 s):

* slow DID directory – ``SimFleet.slow_did(accounts, delay)`` per DID, ``fleet.plc.delay`` for
  every DID: the PLC directory answers after the delay (the document as it was when asked);
  ``plc.did_failures[did]`` / ``plc.failure`` answer with an HTTP error status instead.
* slow or failing handle domains – ``SimFleet.slow_handle(accounts, delay, fail=…)``: the
  handle's DNS TXT ``_atproto.<handle>`` (``SimConfig(dns=True)``, ``fleet.dns``: a DNS server
  on 127.0.0.1 for ``RELAY_DNS_SERVERS``), its address lookup (``fleet.dns.resolve_address``,
  the HTTPS method's first step) and the PLC's ``resolveHandle`` answer after the delay; with
  ``fail`` (``nxdomain`` or ``silent``) the handle does not verify. The account's ``#identity``
  stays ``accept`` (a relay passes it on with the handle stripped).
* getRepo failing for a while – ``SimHost.fail_repos(mode, dids=…, seconds=…, requests=…)``
  (``500``, ``404``, ``timeout``), ``SimHost.heal_repos()``: a resync of a desynchronized
  account fails meanwhile and succeeds afterwards; verdicts are unchanged (the commits that
  follow a ``desync`` are ``accept``: passed on, or covered by the ``#sync`` of the repair).
* key rotations during start-up – ``SimFleet.rotate_keys(accounts)``: a burst of
  ``key_rotation`` while a relay is still catching up; every commit emitted before a rotation
  stays ``accept`` (it was valid when sent).
* ``SimFleet.clear_weather()`` ends the identity weather.

The ground truth assumes a relay that keeps up with the hosts: a commit signed with the old key
(or sent by the old host) that a relay only validates *after* the PLC document changed cannot be
told apart from a forgery, so tests judge live (see ``tests/sim/test_faults.py``).

Reasons are values of ``firehose.reasons.Reason`` (plus the relay's ``wrong_host``).
"""

from __future__ import annotations

from typing import Final

FRAME_FAULTS: Final = ("bad_signature", "broken_chain", "missing_block", "oversized", "duplicate", "replay",
                       "seq_backwards", "wipe_restore", "unreadable", "foreign_sync")
#: Faults that restart the host's stream (seq back to 1): judged by a relay across reconnections.
WIPE_FAULTS: Final = ("seq_backwards", "wipe_restore")
CONNECTION_FAULTS: Final = ("slow", "stall", "disconnect")
ACCOUNT_FAULTS: Final = ("deactivate", "takedown", "key_rotation", "migration")
FAULT_KINDS: Final = FRAME_FAULTS + CONNECTION_FAULTS + ACCOUNT_FAULTS

#: fault kind -> (verdict, reason) expected for the frame the fault produces.
EXPECTED: Final[dict[str, tuple[str, str]]] = {
    "bad_signature": ("reject", "bad_signature"),
    "broken_chain": ("desync", "since_mismatch"),
    "wipe_restore": ("desync", "since_mismatch"),
    "missing_block": ("reject", "missing_mst_block"),
    "oversized": ("reject", "frame_too_large"),
    "duplicate": ("ignore", "seq_not_increasing"),
    "replay": ("ignore", "rev_not_increasing"),
    "migration": ("reject", "wrong_host"),
    "unreadable": ("reject", "bad_body_cbor"),
    "foreign_sync": ("reject", "wrong_host"),
}

#: Verdict kinds (the same words as ``firehose.validate.Verdict.kind``).
VERDICTS: Final = ("accept", "reject", "desync", "ignore")


def check_kind(kind: str) -> str:
    """Return ``kind`` if it is a known fault mode, else raise ``ValueError``."""
    if kind not in FAULT_KINDS:
        raise ValueError(f"unknown fault kind {kind!r}; known: {', '.join(FAULT_KINDS)}")
    return kind
