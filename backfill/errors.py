"""Errors raised by the backfill store and the sequencer. Each carries a snake_case ``reason``."""

from __future__ import annotations

from mst.errors import ReasonError


class BackfillError(ReasonError):
    """Base class; ``reason`` is a short snake_case label usable as a metric label.

    Unlike other :class:`ReasonError` types the message comes first and ``reason`` defaults to
    the class's own (``MigrationError("bad file")``); ``str(exc)`` is the message (or the reason)."""

    reason = "backfill_error"
    show_reason = False

    def __init__(self, message: str = "", *, reason: str | None = None) -> None:
        super().__init__(reason or self.reason, message)


class MigrationError(BackfillError):
    """A migration file is malformed, duplicated, or failed to apply."""

    reason = "migration_failed"


class SequencerLockedError(BackfillError):
    """Another sequencer already holds the single-writer lock on this database (or schema)."""

    reason = "sequencer_locked"


class SequencerConflictError(BackfillError):
    """The stored seq high-water mark moved under this sequencer: someone else wrote events."""

    reason = "sequencer_conflict"


class SequencerClosedError(BackfillError):
    """``submit`` was called on a sequencer that is closed or has failed permanently."""

    reason = "sequencer_closed"


class SeqExhaustedError(BackfillError):
    """The next seq would reach 2**53 (the largest value every consumer can represent)."""

    reason = "seq_exhausted"


class BatchAbortedError(BackfillError):
    """This event's batch was numbered after a batch whose commit failed, so it was not written
    either; nothing of it is stored and the caller may resubmit."""

    reason = "batch_aborted"


class FencedOffError(BackfillError):
    """The event's fence (``firehose.state.Fence``) was revoked before it was numbered: an earlier
    event of the same upstream run was not stored, so this one must not be stored after it either
    (the run re-reads both from its durable cursor)."""

    reason = "fenced_off"
