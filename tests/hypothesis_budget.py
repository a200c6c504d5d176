"""How many examples a Hypothesis test runs.

Normally each test's own number (``examples(400)`` is 400) under Hypothesis' default settings.
Under mutation testing (``./run mutate`` sets ``RELAY_HYPOTHESIS_PROFILE=mutation``) the
``mutation`` profile applies instead: at most :data:`MUTATION_EXAMPLES` examples, derandomized
(the same examples on every run, so a mutant's verdict does not depend on a random draw), no
deadline and no example database. A mutant run executes every function through mutmut's
trampoline, so the full budgets take minutes per test there and time out.

``tests/conftest.py`` loads the profile named by the variable before any test module is imported.
"""

from __future__ import annotations

import os

from hypothesis import HealthCheck, settings

#: The environment variable naming the Hypothesis profile to load (``mutation`` or unset).
PROFILE_VAR = "RELAY_HYPOTHESIS_PROFILE"
MUTATION = "mutation"
#: The most examples one Hypothesis test runs under the ``mutation`` profile.
MUTATION_EXAMPLES = 25

settings.register_profile(
    MUTATION,
    max_examples=MUTATION_EXAMPLES,
    derandomize=True,
    deadline=None,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)


def profile() -> str:
    """The profile this run uses: the variable's value, else Hypothesis' ``default``."""
    return os.environ.get(PROFILE_VAR) or "default"


def load() -> None:
    """Load :func:`profile` (an unknown name fails here, at collection)."""
    settings.load_profile(profile())


def examples(n: int) -> int:
    """A test's example count: ``n``, capped at :data:`MUTATION_EXAMPLES` under mutation testing."""
    return min(n, MUTATION_EXAMPLES) if profile() == MUTATION else n
