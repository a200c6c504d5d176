"""The fixed enumeration of reasons a frame or message is not simply accepted.

Every rejection, ignore, desynchronisation or protocol-level drop in ``firehose`` carries one of
these values. They are metric labels: short, snake_case, never free text. ``Reason`` is a
``StrEnum`` so a member compares equal to (and serialises as) its value.
"""

from __future__ import annotations

from enum import StrEnum


class Reason(StrEnum):
    """All reasons, grouped by the stage that produces them."""

    # --- accept verdicts
    OK = "ok"
    SYNC_RESET = "sync_reset"  # accepted #sync that does not match stored state: resync needed
    LENIENT_NO_PREV_DATA = "lenient_no_prev_data"  # lenient mode: sync 1.0 commit, not inverted
    LENIENT_NO_OP_PREV = "lenient_no_op_prev"  # lenient mode: update/delete op without prev, not inverted

    # --- frame codec (firehose.frames)
    FRAME_TOO_LARGE = "frame_too_large"
    FRAME_EMPTY = "frame_empty"
    BAD_HEADER_CBOR = "bad_header_cbor"
    BAD_BODY_CBOR = "bad_body_cbor"
    HEADER_NOT_MAP = "header_not_map"
    BAD_HEADER_OP = "bad_header_op"
    MISSING_HEADER_TYPE = "missing_header_type"
    BODY_NOT_MAP = "body_not_map"
    TRAILING_BYTES = "trailing_bytes"
    UNKNOWN_OP = "unknown_op"  # ignored, counted
    UNKNOWN_TYPE = "unknown_type"  # ignored, counted
    ERROR_FRAME = "error_frame"

    # --- message schema (firehose.messages)
    MISSING_FIELD = "missing_field"
    BAD_FIELD_TYPE = "bad_field_type"
    BAD_SEQ = "bad_seq"
    BAD_DID = "bad_did"
    BAD_REV = "bad_rev"
    BAD_SINCE = "bad_since"
    BAD_DATETIME = "bad_datetime"
    BAD_HANDLE = "bad_handle"
    BAD_OP = "bad_op"
    BAD_OP_ACTION = "bad_op_action"
    BAD_OP_PATH = "bad_op_path"
    BAD_OP_CID = "bad_op_cid"
    DUPLICATE_OP_PATH = "duplicate_op_path"

    # --- size limits
    TOO_MANY_OPS = "too_many_ops"
    BLOCKS_TOO_LARGE = "blocks_too_large"
    RECORD_TOO_LARGE = "record_too_large"

    # --- CAR slice and commit object
    BAD_CAR = "bad_car"
    BAD_BLOCK_HASH = "bad_block_hash"
    CAR_ROOT_MISMATCH = "car_root_mismatch"
    COMMIT_CID_MISMATCH = "commit_cid_mismatch"
    MISSING_COMMIT_BLOCK = "missing_commit_block"
    BAD_COMMIT = "bad_commit"
    COMMIT_DID_MISMATCH = "commit_did_mismatch"
    COMMIT_REV_MISMATCH = "commit_rev_mismatch"
    MISSING_RECORD_BLOCK = "missing_record_block"
    BAD_RECORD = "bad_record"  # a created/updated record that is not a DAG-CBOR map

    # --- MST operation inversion
    MISSING_PREV_DATA = "missing_prev_data"
    MISSING_MST_BLOCK = "missing_mst_block"
    BAD_MST = "bad_mst"
    INVERSION_INVALID_OP = "inversion_invalid_op"
    INVERSION_MISMATCH = "inversion_mismatch"
    PREV_DATA_WRONG = "prev_data_wrong"
    OPS_NOT_IN_TREE = "ops_not_in_tree"  # lenient mode: an op's outcome is not in the signed tree

    # --- identity / signature
    BAD_SIGNING_KEY = "bad_signing_key"
    BAD_SIGNATURE = "bad_signature"  # caller may refresh identity once and retry

    # --- revision ordering (ignore) and time
    REV_IN_FUTURE = "rev_in_future"
    REV_NOT_INCREASING = "rev_not_increasing"
    DUPLICATE_EVENT = "duplicate_event"
    SYNC_ROLLBACK = "sync_rollback"
    ACCOUNT_INACTIVE = "account_inactive"

    # --- chain (desynchronised)
    SINCE_MISMATCH = "since_mismatch"
    PREV_DATA_MISMATCH = "prev_data_mismatch"
    RESYNC_IN_PROGRESS = "resync_in_progress"

    # --- subscriber (per-connection stream hygiene)
    SEQ_NOT_INCREASING = "seq_not_increasing"
    MISSING_SEQ = "missing_seq"
    FUTURE_CURSOR = "future_cursor"
    SEQ_WENT_BACKWARDS = "seq_went_backwards"
    CONNECTION_FAILED = "connection_failed"
    INFO_OUTDATED_CURSOR = "info_outdated_cursor"
    INFO_OTHER = "info_other"

    # --- pipeline
    VALIDATOR_CRASHED = "validator_crashed"
    # --- host binding and account admission (the account's lane)
    WRONG_HOST = "wrong_host"  # the sender is not the account's PDS (per a fresh DID document)
    RELAY_NOT_AUTHORITATIVE = "relay_not_authoritative"  # a relay upstream may not speak for the account
    ACCOUNT_THROTTLED = "account_throttled"  # over the host's account limit: held, resynced later
    HANDLE_NOT_VERIFIED = "handle_not_verified"  # #identity passed on without its handle
    HANDLE_VERIFIED_LATE = "handle_verified_late"  # a slow handle verified: #identity with it emitted
    UNSEEN_HISTORY = "unseen_history"  # a first-seen account's commit chains on one the relay should have seen
    UNREFERENCED_BLOCKS = "unreferenced_blocks"  # #commit/#sync passed on without blocks nothing references
    RESYNC_PENDING = "resync_pending"  # buffered until the account's resync completes
    RESYNC_BUFFER_FULL = "resync_buffer_full"  # dropped: covered by the resync anyway
    COVERED_BY_RESYNC = "covered_by_resync"  # buffered frame not newer than the resync's commit
    ALREADY_SEQUENCED = "already_sequenced"  # the store already held a newer rev at write time
    INTERNAL_ERROR = "internal_error"
    SUBSCRIBER_ERROR = "subscriber_error"
    # --- identity resolution (relay.identity.IdentityError reasons, prefixed)
    IDENTITY_BAD_DID = "identity_bad_did"
    IDENTITY_BAD_DID_DOCUMENT = "identity_bad_did_document"
    IDENTITY_DID_NOT_FOUND = "identity_did_not_found"
    IDENTITY_NO_SIGNING_KEY = "identity_no_signing_key"
    IDENTITY_RATE_LIMITED = "identity_rate_limited"
    IDENTITY_RESOLUTION_FAILED = "identity_resolution_failed"
    # --- the JSON stream's subscriber options and messages (firehose.jetstream)
    JETSTREAM_BAD_COLLECTION = "jetstream_bad_collection"
    JETSTREAM_TOO_MANY_COLLECTIONS = "jetstream_too_many_collections"
    JETSTREAM_BAD_DID = "jetstream_bad_did"
    JETSTREAM_TOO_MANY_DIDS = "jetstream_too_many_dids"
    JETSTREAM_BAD_MAX_SIZE = "jetstream_bad_max_size"
    JETSTREAM_BAD_CURSOR = "jetstream_bad_cursor"
    JETSTREAM_BAD_MESSAGE = "jetstream_bad_message"


ALL_REASONS: frozenset[str] = frozenset(r.value for r in Reason)
