"""Ingest: everything between an upstream socket and the sequencer.

* ``hostruns`` — one run per followed host: its subscriber, its window of frames read and not
  done, its watermark (the host cursor);
* ``lanes`` — one lane per account: the single owner of the account's state in flight, which
  judges its frames in order and is the only writer of its row (through the sequencer);
* ``admission`` — who may speak for an account, and how many accounts a host may bring;
* ``resync`` / ``resync_queue`` — repairing desynchronized accounts from their PDS.

Control flows one way: subscriber → host run → lane → sequencer; outcomes come back as values
(futures), never as calls up the chain.
"""
