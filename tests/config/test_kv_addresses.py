"""The KV address variables: one reading of them for the side channel and the
KV-event publisher."""

import pytest

from pdfleet.engine.config.kv_transfer import (
    KV_BIND_IP_ENV,
    KV_IP_ENV,
    KVTransferConfig,
    kv_bind_host,
    kv_host,
)
from pdfleet.engine.kv_transfer.connector import kv_addresses


@pytest.fixture(autouse=True)
def no_kv_env(monkeypatch):
    monkeypatch.delenv(KV_IP_ENV, raising=False)
    monkeypatch.delenv(KV_BIND_IP_ENV, raising=False)


def test_the_pod_ip_wins_and_the_bind_ip_binds(monkeypatch):
    kv = KVTransferConfig(kv_connector="ZmqConnector", kv_role="kv_producer", kv_ip="10.0.0.9")
    assert (kv_host(kv), kv_bind_host(kv)) == ("10.0.0.9", "10.0.0.9")
    # No connector, no variables: the KV-event publisher keeps its own endpoint.
    assert kv_host(None) is None and kv_bind_host(KVTransferConfig()) is None
    monkeypatch.setenv(KV_IP_ENV, "10.1.1.1")
    assert (kv_host(None), kv_bind_host(kv)) == ("10.1.1.1", "10.1.1.1")
    monkeypatch.setenv(KV_BIND_IP_ENV, "192.168.0.2")
    assert kv_addresses(kv) == ("10.1.1.1", "192.168.0.2")
    monkeypatch.setenv(KV_BIND_IP_ENV, "0.0.0.0")  # noqa: S104 (the refused address under test)
    with pytest.raises(ValueError, match="binds one address"):
        kv_addresses(kv)
