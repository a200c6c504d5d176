"""Fixtures of the resources suite."""

from tests.relay.test_jetstream_slow import store  # noqa: F401 - a migrated SQLite store in tmp_path
