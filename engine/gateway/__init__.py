"""The OpenAI-compatible gateway of a prefill/decode fleet (``pdfleet gateway``).

One file per concern:

* ``discovery`` — where engines come from (static flags, an engines file that
  is re-read on change, Kubernetes pods), behind one ``poll()`` interface;
* ``engines`` — the engine pool: health checks, metric scrapes, ejection and
  re-admission;
* ``prompt`` — prompt length and leading-block hashes (tokenizer or chars);
* ``routing`` — load- and prefix-aware choice, compat-hash pairing, the
  disaggregation decision;
* ``proxy`` — the two-leg P/D protocol and the stream relay;
* ``metrics`` — ``pdfleet_gateway_*``;
* ``app`` — the HTTP routes and the server; ``cli`` — the command.

Imports no torch: a gateway pod needs only the HTTP stack.
"""
