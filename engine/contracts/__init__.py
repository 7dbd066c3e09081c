"""What crosses a process: one named, typed carrier per message, with one
encode and one decode.

Every pdfleet process that talks to another (an engine and its clients, the
gateway and its engines) builds and reads these messages here, so a sender
and a receiver cannot drift apart. The package imports no torch and nothing
of pdfleet but its configuration (an import-linter contract): a gateway pod
and the operator may use it.

* ``errors`` — OpenAI's error body, answered by engines and the gateway alike.
"""
