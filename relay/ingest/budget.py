"""The ingest host runs' shared in-flight budget: ``firehose.budget.ByteBudget`` (one line, first
come, first served; the replay budget is the same class with two lines)."""

from __future__ import annotations

from firehose.budget import ByteBudget

__all__ = ["ByteBudget"]
