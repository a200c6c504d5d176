"""The Hypothesis budget under mutation testing (``tests/hypothesis_budget.py``): ``./run mutate``
selects the ``mutation`` profile, which caps and derandomizes every property test; without it each
test keeps its own budget."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

PROBE = """
from hypothesis import settings
import tests.conftest  # loads the profile, as pytest does before any test module
from tests import hypothesis_budget
s = settings.default
print(hypothesis_budget.examples(400), hypothesis_budget.examples(10), s.max_examples, s.derandomize, s.database)
"""


def probe(profile: str | None) -> str:
    env = {k: v for k, v in os.environ.items() if k != "RELAY_HYPOTHESIS_PROFILE"}
    if profile is not None:
        env["RELAY_HYPOTHESIS_PROFILE"] = profile
    done = subprocess.run([sys.executable, "-c", PROBE], cwd=ROOT, env=env, capture_output=True, text=True,
                          check=True)
    return done.stdout.strip()


def test_the_mutation_profile_caps_and_derandomizes() -> None:
    assert probe("mutation") == "25 10 25 True None"


def test_without_it_each_test_keeps_its_budget() -> None:
    count, small, _, derandomize, _ = probe(None).split()
    assert (count, small, derandomize) == ("400", "10", "False")


def test_run_mutate_selects_the_mutation_profile() -> None:
    run = (ROOT / "run").read_text()
    case = run[run.index("  mutate)"):]
    case = case[: case.index(";;")]
    assert re.search(r"export RELAY_HYPOTHESIS_PROFILE=\$\{RELAY_HYPOTHESIS_PROFILE:-mutation\}", case)
    assert case.index("RELAY_HYPOTHESIS_PROFILE") < case.index("mutmut run")
