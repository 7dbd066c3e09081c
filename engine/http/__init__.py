"""pdfleet's HTTP/1.1 stack, shared by the engine server and the gateway.

* ``server`` — the server both serve through: an ``asyncio.Protocol`` parsed
  by httptools, keep-alive, pipelining, chunked bodies, head and chunk bounds,
  disconnect detection, graceful stop; any ASGI app, or a route table called
  directly;
* ``asgi`` — the route-table app and what its handlers read and answer, the
  ASGI lifespan protocol;
* ``limits`` — a request body's size and time limits, as a handler reads it;
* ``upstream`` — the gateway's lean client for its calls to engines.

The limits are ``RequestLimits`` (engine/contracts/http_limits.py); every refusal
is OpenAI's error body (engine/contracts/errors.py). Imports no torch and
nothing of pdfleet but its config and contracts (import-linter).
"""
