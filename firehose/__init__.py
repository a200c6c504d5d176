"""The firehose: wire protocol and judgement (knows no SQL).

* ``frames`` — frame codec (header + payload, error frames, ``#info``, 5 MB limit)
* ``messages`` — typed ``#commit #sync #identity #account #info`` models, strict parsing
* ``reasons`` — the fixed enumeration of verdict/drop reasons (metric labels)
* ``validate`` — pure commit/sync validation returning a ``Verdict``
* ``pipeline`` — validation on a process pool, per-DID ordered, identity refresh on bad signature
* ``subscriber`` / ``ratelimit`` — one upstream host: keepalive, backoff, seq hygiene, cursor resets
* ``bus`` — in-process and Redis Streams event buses
* ``broadcast`` — per-consumer replay-then-live delivery; ``serve_asgi`` / ``serve_websockets``
  are its two transports
"""
