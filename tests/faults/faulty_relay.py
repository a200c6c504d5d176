"""A relay that crashes between commit and publish, for the fault suite (scenario ``ingest_kill_unpublished``).

``python -m tests.faults.faulty_relay N ingest [relay options]`` runs ``relay ingest`` (``relay.serve``)
with ``ExitBeforePublish``: the service's publish step wrapped so that its ``N``-th call ends the
process at once (exit status 137, no cleanup, as SIGKILL would) after the sequencer has committed
the batch. The fault lives here, in the tests; production code only lets a subclass wrap its
publish step (``RelayService.sequencer_publish``).
"""

from __future__ import annotations

import logging
import os
import sys

from backfill.sequencer import Publish
from firehose.publisher import BusPublisher
from firehose.state import SequencedEvent
from relay.config import RelayConfig
from relay.service import RelayService

log = logging.getLogger("tests.faults.faulty_relay")

#: The line the process logs as it exits through the fault (the scenario looks for it).
EXIT_MESSAGE = "fault injection: exiting before publishing a committed batch"


def exit_before_publish(publish: Publish, nth: int) -> Publish:
    """``publish``, except that its ``nth`` call ends the process at once, without publishing."""
    calls = 0

    async def publish_or_exit(events: list[SequencedEvent]) -> None:
        nonlocal calls
        calls += 1
        if calls >= nth:
            log.warning(EXIT_MESSAGE, extra={"fields": {"first_seq": events[0].seq if events else None}})
            logging.shutdown()
            os._exit(137)
        await publish(events)

    return publish_or_exit


def service_class(nth: int) -> type[RelayService]:
    """A ``RelayService`` whose ``nth`` publish ends the process (``exit_before_publish``)."""

    class ExitBeforePublish(RelayService):
        def __init__(self, config: RelayConfig, *, role: str = "serve") -> None:
            super().__init__(config, role=role)

        def sequencer_publish(self, publisher: BusPublisher) -> Publish:
            return exit_before_publish(super().sequencer_publish(publisher), nth)

    return ExitBeforePublish


def main(argv: list[str]) -> int:
    from relay.serve import main as serve_main

    nth, role, rest = int(argv[0]), argv[1], argv[2:]
    return serve_main(["--role", role, *rest], service_class=service_class(nth))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
