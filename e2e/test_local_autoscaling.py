"""`pdfleet up` with decode autoscaling: load raises decode replicas, quiet brings them
back after the window, and no request fails while engines drain."""

from __future__ import annotations

import threading
import time

import httpx
import pytest
from helpers.server import wait_until
from helpers.up import Up, fleet_spec


def decode_count(up: Up) -> int:
    return sum(1 for e in up.engines() if e["role"] == "decode")


def drained(up: Up) -> bool:
    """A decode engine was drained and its process has exited."""
    out = up.output()
    at = out.find("draining decode")
    return at >= 0 and " stopped (exit" in out[at:]


OUTPUT_LEN = 120


class Load:
    """``clients`` closed-loop clients, each sending one greedy completion of
    ``OUTPUT_LEN`` tokens after another until :meth:`finish`: a load that lasts
    exactly as long as the condition it is there for."""

    def __init__(self, url: str, clients: int) -> None:
        self.completed = 0
        self.failures: list[str] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._client, args=(url, i)) for i in range(clients)
        ]
        for t in self._threads:
            t.start()

    def _client(self, url: str, i: int) -> None:
        # About 48 prompt tokens: one per word of the tiny model's tokenizer.
        prompt = f"client {i} " + " ".join(f"word{(i * 7 + k) % 50}" for k in range(46))
        body = {
            "model": "tiny",
            "prompt": prompt,
            "max_tokens": OUTPUT_LEN,
            "temperature": 0,
            "ignore_eos": True,
        }
        with httpx.Client(timeout=120) as client:
            while not self._stop.is_set():
                try:
                    r = client.post(url + "/v1/completions", json=body)
                    r.raise_for_status()
                    tokens = r.json()["usage"]["completion_tokens"]
                    if tokens != OUTPUT_LEN:
                        raise RuntimeError(f"{tokens} tokens of {OUTPUT_LEN}")
                    with self._lock:
                        self.completed += 1
                except Exception as e:
                    with self._lock:
                        self.failures.append(repr(e))

    def finish(self) -> Load:
        """Stop sending; wait for the requests in flight."""
        self._stop.set()
        for t in self._threads:
            t.join(180)
        assert not any(t.is_alive() for t in self._threads)
        return self


@pytest.fixture(scope="module")
def scaled_fleet(tiny_model, tmp_path_factory):
    spec = fleet_spec(
        tiny_model,
        # A small decode engine: 4 sequences at once, 48 blocks of 16 tokens.
        decode={"replicas": 1, "engine": {"maxNumSeqs": 4, "numGpuBlocksOverride": 48}},
        disaggregation={"mode": "Disabled"},
        kvTransfer={},
        autoscaling={
            "periodSeconds": 2,
            "metricsStaleSeconds": 10,
            "decode": {
                "minReplicas": 1,
                # One step up and one down prove both directions; a third engine
                # would only add a start and a second drain window.
                "maxReplicas": 2,
                "targetWaitingPerReplica": 2,
                "scaleDownStabilizationSeconds": 12,
                "maxScaleUpStep": 2,
            },
            "prefill": {"minReplicas": 1, "maxReplicas": 1},
        },
    )
    up = Up(spec, tmp_path_factory.mktemp("autoscale"), "autoscale")
    try:
        yield up.wait_ready()
    finally:
        assert up.stop() == 0, up.output()[-3000:]


def test_load_scales_decode_up_and_quiet_scales_it_back_without_failures(scaled_fleet):
    up = scaled_fleet
    assert decode_count(up) == 1
    # 16 clients against one engine of 4 sequences, until the autoscaler adds one.
    heavy = Load(up.url, 16)
    try:
        assert wait_until(lambda: decode_count(up) >= 2, 60, 0.5), up.output()[-3000:]
    finally:
        heavy.finish()
    assert "autoscaler" in up.output() or "starting decode-1" in up.output()
    # A trickle flows through the first 20 s of the quiet, then the fleet is
    # idle (a load that stays flat holds the longer, steady-load down window).
    trickle = Load(up.url, 1)
    started = time.monotonic()
    try:
        wait_until(lambda: decode_count(up) == 1 and drained(up), 20, 0.5)
    finally:
        trickle.finish()
    assert wait_until(lambda: decode_count(up) == 1 and drained(up), 120, 0.5), up.output()[-3000:]
    # Not before the down window (12 s) has passed since the load stopped.
    assert time.monotonic() - started >= 8
    assert "draining decode" in up.output()
    for name, load in (("heavy", heavy), ("trickle", trickle)):
        assert load.failures == [], (name, load.failures[:5])
        assert load.completed > 0
