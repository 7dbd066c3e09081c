"""What crosses a process: one named, typed carrier per message, with one
encode and one decode.

Every pdfleet process that talks to another (an engine and its clients, the
gateway and its engines, the operator and the pods it starts) builds and
reads these messages here, so a sender and a receiver cannot drift apart.
The package imports no torch and nothing else of pdfleet (import-linter
contracts): a gateway pod, the operator and the configuration use it.

* ``errors`` — OpenAI's error body, answered by engines and the gateway alike.
* ``kv_params`` — ``kv_transfer_params`` (``KVTransferParams``), their signing,
  and their refusal (``RefusedParams``: a 400 with ``param`` the field, which
  the gateway reads).
* ``lora`` — the run-time LoRA routes' body (``LoRALoad``) and what a load's
  answer means (``load_succeeded``, ``name_taken``).
* ``model_card`` — the ``/v1/models`` entries (``ModelCard``): engines and the
  gateway write them; the gateway, the operator, ``pdfleet up`` and the
  autoscaling lab read them.
* ``migration`` — a decode leg's migration state (``MigrationState``: the
  gateway encodes it, the engine's request model decodes it) and the SSE
  comments of a migratable stream.
* ``engines_file`` — the engines file (``EnginesFile`` of ``EngineEntry``):
  ``pdfleet up`` writes it, the gateway's discovery reads it.
* ``pod_labels`` — the labels and annotations the operator puts on engine pods
  and the gateway's Kubernetes discovery reads.
* ``kv_connector`` — the KV connector's metadata between its sides, the
  producer's handshake reply (``HandshakeReply``: its ``KVLayoutWire`` and, for
  NIXL, one ``ShardInfo`` per rank), and the tensor-parallel shard commands.
* ``kv_side_channel`` — the KV side channel's handshake (hello, its reply,
  auth, refusals), the envelope of its later messages, and the lease
  messages (``LeaseUse``: claim and read; ``LeaseEnd``: confirm and release).
* ``tp_wire`` — what the tensor-parallel main process and its rank processes
  exchange: the step (a new request's sampling as ``StepSampling``), its
  result, READY and errors, the rendezvous store's records.
* ``kv_events`` — the KV-cache events an engine publishes and the gateway's
  index reads.
* ``gateway_events`` — the events the workers of one gateway pass each other.
* ``gateway_worker_job`` — what ``pdfleet gateway --workers N`` sends each
  worker it starts (``WorkerJob``).
* ``gateway_view`` — the gateway's ``/engines`` answer (``EnginesView``), which
  ``pdfleet status`` decodes.
* ``grammar_worker`` — the frames between an engine and its grammar compile
  workers (``CompileRequest``; ``Compiled``, ``TooLarge``, ``Failed``).
* ``request_fields`` — the OpenAI routes' request fields: which work, which
  are refused by name, and the one check engines and the gateway both run.
* ``chat_template`` — what a chat template is given, alike in the engine and
  the gateway: ``--chat-template``'s loading rule and each message's fields.
* ``priority`` — the ``priority`` the gateway sends engines: a band and a
  fair-share tag.
* ``block_hash`` — the chained block hashes both sides of a prefix match compute.
* ``metrics`` — every metric name and label pdfleet exports or reads (the
  label names readers select by, and the label values they count), and the
  one ``/metrics`` parser (the gateway workers' merged exposition reads with it too).
* ``http_limits`` — what one HTTP request may cost a server.
* ``sampling_checks`` — the sampling fields' admissibility, checked alike by
  engines and the gateway.
* ``security``, ``identity``, ``identity_exchange`` — credentials: API keys,
  the fleet secret, signed fields, fleet identities, and how an engine pod
  obtains its identity token from the operator.
* ``model_source`` — the ``hf://`` grammar, the variables a model fetch reads,
  pdfleet's one cache directory.
* ``launch`` — the command line pdfleet starts its own processes with.
"""
