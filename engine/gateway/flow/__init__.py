"""Flow control in the gateway: tenants, their limits, and the fair queue.

``tenants`` (who a key belongs to and what it may do), ``control``
(admission by tenant: in-flight and rate limits, 429 with Retry-After),
``queue`` (strict priority bands, weighted fair share by tokens within one)
and ``gate`` (what the proxy calls per request). See docs/flow-control.md.
"""
