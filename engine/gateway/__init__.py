"""The OpenAI-compatible gateway of a prefill/decode fleet (``pdfleet gateway``).

One file per concern, one per step of the two-leg protocol (docs/gateway.md):

* ``app`` — the HTTP routes and the ``Gateway`` a process holds; ``cli`` — the
  command; ``workers`` — one gateway or ``--workers N`` of them, and
  ``siblings`` what those share;
* ``proxy`` — ``handle`` → ``route`` → the legs; ``call`` — one request as the
  legs carry it;
* ``prefill_leg``, ``decode_leg`` — the two legs (retries, failover, the hold,
  the KV-pair breaker's failures); ``relay`` — a streamed decode leg's SSE
  events and disconnects; ``legs`` — what they share; ``answers`` — the
  gateway's own error answers;
* ``routing`` — load- and prefix-aware choice, compat-hash pairing, the
  disaggregation decision; ``engines`` — the engine pool: health checks,
  metric scrapes, ejection and re-admission; ``kv_index`` — the exact prefix
  index from KV events; ``prompt`` — prompt length and leading-block hashes;
  ``discovery`` — where engines come from; ``metrics`` — ``pdfleet_gateway_*``.

The HTTP server, the route table, the body limits and the engine client are
``engine/http/`` (the engine server's too); the error body is
``engine/contracts/errors.py``. Imports no torch: a gateway pod needs only
the HTTP stack.
"""
