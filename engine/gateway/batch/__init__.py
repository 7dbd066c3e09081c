"""The OpenAI Batch API in the gateway: ``/v1/files`` and ``/v1/batches``.

``store`` (durable state: SQLite and the files, in ``--data-dir``), ``api``
(the routes, as the official ``openai`` client calls them) and ``runner``
(runs the requests of batches in the batch band, on capacity online traffic
leaves idle). See docs/flow-control.md, "The Batch API".
"""
