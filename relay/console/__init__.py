"""The operator console behind ``/dashboard`` (see ``relay.dashboard`` for the routes):
``ledger`` (verdicts per host), ``reports`` (each process's report, shared through Redis in
scale-out), ``api`` (the console's JSON endpoints and its actions)."""
