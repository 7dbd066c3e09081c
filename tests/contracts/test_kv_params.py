"""kv_transfer_params: vLLM's names on the wire, one decoder, and the fleet's signature."""

import dataclasses
import time

import pytest

from pdfleet.engine.contracts import kv_params
from pdfleet.engine.contracts.kv_params import REMOTE_DECODE, KVTransferParams

SECRET = b"s" * 32

PRODUCER = KVTransferParams(
    do_remote_prefill=True,
    remote_engine_id="e1",
    remote_instance_id="i1",
    remote_host="10.0.0.1",
    remote_port=5600,
    remote_block_ids=(1, 2),
    remote_request_id="r",
    tp_size=2,
    lease_id="lease",
    compat={"model": "m", "block_size": 16},
    compat_hash="c0ffee",
    block_chain=None,
    block_hash_algo="sha256",
)


def test_a_prefill_leg_asks_in_vllm_s_own_words():
    assert REMOTE_DECODE.to_wire() == {
        "do_remote_decode": True,
        "do_remote_prefill": False,
        "remote_engine_id": None,
        "remote_block_ids": None,
        "remote_host": None,
        "remote_port": None,
    }


def test_the_wire_form_decodes_back_to_the_same_params_and_names_the_lease_fields():
    wire = PRODUCER.to_wire()
    assert KVTransferParams.from_wire(wire) == PRODUCER
    # A lease's fields travel together, a null content hash included; no producer
    # identity when there is none.
    assert wire["pdfleet_lease_id"] == "lease" and "pdfleet_block_chain" in wire
    assert "pdfleet_producer" not in wire and "pdfleet_sig" not in wire
    assert wire["remote_block_ids"] == [1, 2]


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("remote_port", "5600", "remote_port is not a port"),
        ("remote_port", 70000, "remote_port is not a port"),
        ("remote_block_ids", [1, -1], "remote_block_ids must be block ids"),
        ("remote_block_ids", [True], "remote_block_ids must be block ids"),
        ("remote_host", 1, "remote_host must be a string"),
        ("tp_size", "2", "tp_size must be an integer"),
        ("pdfleet_compat", [1], "pdfleet_compat must be an object"),
        ("pdfleet_produce", 1, "pdfleet_produce must be a boolean"),
    ],
)
def test_a_field_of_the_wrong_type_is_named(field, value, message):
    with pytest.raises(ValueError, match=f"kv_transfer_params: {message}"):
        KVTransferParams.from_wire({**PRODUCER.to_wire(), field: value})


def test_signed_params_verify_and_any_change_or_expiry_is_refused():
    signed = kv_params.sign(SECRET, PRODUCER, ttl=30)
    wire = signed.to_wire()
    assert kv_params.verify(SECRET, wire) == signed
    assert dataclasses.replace(signed, expires=None, signature=None) == PRODUCER
    for field, value in [("remote_block_ids", [1, 3]), ("remote_port", 6), ("extra", 1)]:
        with pytest.raises(kv_params.InvalidParams, match="signature"):
            kv_params.verify(SECRET, {**wire, field: value})
    with pytest.raises(kv_params.InvalidParams, match="signature"):
        kv_params.verify(b"t" * 32, wire)
    with pytest.raises(kv_params.InvalidParams, match="not signed"):
        kv_params.verify(SECRET, PRODUCER.to_wire())
    with pytest.raises(kv_params.InvalidParams, match="expired"):
        kv_params.verify(SECRET, wire, now=time.time() + 31)


def test_the_gateway_may_ask_signed_params_to_end_as_a_prefill_leg():
    # A prefill engine that pulls a peer's cached prefix first: the producer's
    # signed params plus ``pdfleet_produce``, which the signature does not cover
    # (the producer never wrote it; the gateway asks it of the consumer).
    wire = kv_params.sign(SECRET, PRODUCER, ttl=30).to_wire()
    assert "pdfleet_produce" not in wire
    both = kv_params.verify(SECRET, {**wire, "pdfleet_produce": True})
    assert both.do_remote_prefill and both.produce and both.produces
    assert both.to_wire()["pdfleet_produce"] is True
    kv_params.verify(SECRET, both.to_wire())  # the engine re-verifies what it stored
    # Once the pull is over (done, failed or dropped) it is a plain prefill leg.
    assert both.after_load() == REMOTE_DECODE
    assert kv_params.verify(SECRET, wire).after_load() is None


def test_the_wire_form_is_the_dict_the_previous_producer_signed():
    # An engine of the previous build signed the dict it sent, with the same
    # canonical JSON: what it signed verifies here, and the reverse.
    old = {
        "do_remote_prefill": True,
        "do_remote_decode": False,
        "remote_engine_id": "e1",
        "remote_instance_id": "i1",
        "remote_host": "10.0.0.1",
        "remote_port": 5600,
        "remote_block_ids": [1, 2],
        "remote_request_id": "r",
        "tp_size": 2,
        "pdfleet_lease_id": "lease",
        "pdfleet_compat": {"model": "m", "block_size": 16},
        "pdfleet_compat_hash": "c0ffee",
        "pdfleet_block_chain": None,
        "pdfleet_block_hash_algo": "sha256",
    }
    assert PRODUCER.to_wire() == old
