"""The engine loop: the asyncio front (``async_engine``), text in and
``RequestOutput``s out (``llm_engine``), one step of schedule, run and
update (``engine_core``), detokenization and stops (``output_processor``,
``detokenizer``)."""
