"""Peer pulls between aggregated ``kv_both`` engines (real processes, NIXL in host
memory): a holder lends the cached prefix blocks it holds, from its device or its
host tier, under a prefill leg's lease; a puller pulls them and computes the tail.
Then the gateway (``--peer-pull``) choosing holder, pull or recompute by measured
cost, and falling back to recomputing when the holder no longer has the blocks."""

from __future__ import annotations

import json
import math
import os
import signal
import socket
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from helpers.fleet import engines_view, metric, start_gateway
from helpers.server import ServerProcess, fleet_headers, free_port, scrape, wait_until

MAX_LEN = 4096
BLOCK = 16
LOADED = "pdfleet_engine_kv_offload_loaded_bytes_total"
PULLED = "pdfleet_engine_kv_transfer_blocks_pulled_total"
DECISIONS = "pdfleet_gateway_peer_pull_decisions_total"
PROMPT_TOKENS = "pdfleet_engine_prompt_tokens_total"


def post(url: str, **kw) -> httpx.Response:
    return httpx.post(url, headers=fleet_headers(), **kw)


def kv_args(role: str, **extra) -> list[str]:
    cfg = {"kv_connector": "NixlConnector", "kv_role": role, "kv_port": free_port()}
    cfg["kv_connector_extra_config"] = extra
    return ["--kv-transfer-config", json.dumps(cfg)]


def events_args(pub: int, replay: int) -> list[str]:
    config = {
        "enable_kv_cache_events": True,
        "endpoint": f"tcp://127.0.0.1:{pub}",
        "replay_endpoint": f"tcp://127.0.0.1:{replay}",
        "heartbeat_interval": 0.5,
    }
    return ["--kv-events-config", json.dumps(config)]


def prompt_of(n: int, seed: int) -> list[int]:
    return [(seed * 131 + i * 17) % 1700 + 20 for i in range(n)]


def both(model: str, logs, name: str, *extra: str, env: dict | None = None) -> ServerProcess:
    return ServerProcess(
        [
            "serve",
            model,
            "--max-model-len",
            str(MAX_LEN),
            "--disable-log-stats",
            *extra,
            *kv_args("kv_both", lease_seconds=10),
        ],
        logs,
        name,
        env={"OMP_NUM_THREADS": "1", **(env or {})},
    )


class PausableForwarder:
    """A TCP forwarder in front of an engine's KV event stream: while paused it
    holds what the engine publishes, so the gateway's index keeps what it saw."""

    def __init__(self, target_port: int) -> None:
        self.target = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        self.open = threading.Event()
        self.open.set()
        self.closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while not self.closed:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target), timeout=5)
            except OSError:  # the engine is gone (killed by a test)
                client.close()
                continue
            upstream.settimeout(None)
            threading.Thread(target=self._pipe, args=(client, upstream, False), daemon=True).start()
            threading.Thread(target=self._pipe, args=(upstream, client, True), daemon=True).start()

    def _pipe(self, src: socket.socket, dst: socket.socket, gated: bool) -> None:
        try:
            while data := src.recv(65536):
                if gated:
                    self.open.wait()
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                s.close()

    def close(self) -> None:
        self.closed = True
        self.open.set()
        self.listener.close()


@pytest.fixture(scope="module")
def wide_model(tiny_model_factory) -> str:
    """A tiny model eight times the default's compute per token: its prefill is slow
    enough next to a lend that the pull/recompute crossover falls inside MAX_LEN
    on a CPU."""
    return tiny_model_factory("llama", hidden_size=128, intermediate_size=512, num_hidden_layers=4)


@pytest.fixture(scope="module")
def peers(wide_model, tmp_path_factory):
    """A holder (one request at a time, 400 device blocks, a host tier behind them)
    and a puller whose READs can be delayed (the transports' test hook), both
    publishing KV events, and a gateway with peer pulls over them; the holder's
    event stream passes a forwarder the tests can pause."""
    logs = tmp_path_factory.mktemp("peer-pull")
    delay = logs / "read-delay"
    delay.write_text("0")
    step_delay = logs / "step-delay"
    step_delay.write_text("0")
    ports = {name: (free_port(), free_port()) for name in ("holder", "puller")}
    holder = both(
        wide_model,
        logs,
        "holder",
        "--max-num-seqs",
        "1",
        "--num-gpu-blocks-override",
        "400",
        "--kv-offload-bytes",
        "8M",
        *events_args(*ports["holder"]),
        env={"PDFLEET_FAULT_STEP_DELAY_FILE": str(step_delay)},
    )
    puller = both(
        wide_model,
        logs,
        "puller",
        *events_args(*ports["puller"]),
        env={"PDFLEET_KV_TEST_READ_DELAY_FILE": str(delay)},
    )
    # Killed by a test; started with the others, which it would otherwise wait for.
    doomed = both(wide_model, logs, "doomed")
    forwarder = PausableForwarder(ports["holder"][0])
    gateway = None
    try:
        holder.wait_healthy()
        puller.wait_healthy()
        doomed.wait_healthy()
        events = {"holder": forwarder.port, "puller": ports["puller"][0]}
        engines_file = logs / "engines.json"
        engines_file.write_text(
            json.dumps(
                {
                    "engines": [
                        {
                            "url": p.url,
                            "role": "decode",
                            "kv_events": f"tcp://127.0.0.1:{events[name]}",
                            "kv_events_replay": f"tcp://127.0.0.1:{ports[name][1]}",
                        }
                        for name, p in (("holder", holder), ("puller", puller))
                    ]
                }
            )
        )
        gateway = peer_gateway(engines_file, logs, "Disabled")
        yield {
            "events": {"holder": (forwarder.port, ports["holder"][1]), "puller": ports["puller"]},
            "holder": holder.url,
            "holder_proc": holder,
            "puller": puller.url,
            "gateway": gateway.url,
            "logs": logs,
            "delay": delay,
            "step_delay": step_delay,
            "forwarder": forwarder,
            "doomed": doomed,
        }
    finally:
        if gateway is not None:
            gateway.stop()
        forwarder.close()
        for proc in (holder, puller, doomed):
            proc.stop()


def complete(url: str, body: dict, **extra) -> str:
    r = post(url + "/v1/completions", json={**body, **extra}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def lend(url: str, body: dict, blocks: int) -> httpx.Response:
    return post(
        url + "/v1/completions",
        timeout=60,
        json={
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {"do_remote_decode": True, "pdfleet_lend_blocks": blocks},
        },
    )


def body_of(seed: int, prefix: int = 200, tail: int = 60) -> dict:
    prompt = prompt_of(prefix, seed) + prompt_of(tail, seed + 1000)
    return {"prompt": prompt, "max_tokens": 8, "temperature": 0, "ignore_eos": True}


def recomputed(url: str, body: dict) -> str:
    """The same prompt computed from scratch there (another cache namespace)."""
    return complete(url, body, cache_salt="reference")


def pulled(peers, body: dict, blocks: int) -> tuple[str, float]:
    before = scrape(peers["puller"]).get(PULLED, 0.0)
    r = lend(peers["holder"], body, blocks)
    assert r.status_code == 200, r.text
    params = r.json()["kv_transfer_params"]
    assert len(params["remote_block_ids"]) == blocks
    r = post(
        peers["puller"] + "/v1/completions",
        timeout=120,
        json={**body, "kv_transfer_params": params},
    )
    assert r.status_code == 200, r.text
    # The pulled blocks count as cached prompt tokens in usage (as vLLM counts a
    # connector's tokens): the puller computed only the tail.
    assert r.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == blocks * BLOCK
    return r.json()["choices"][0]["text"], scrape(peers["puller"])[PULLED] - before


def test_an_engine_that_served_nothing_shows_its_kv_block_bytes(peers):
    """``doomed`` has served nothing yet (the module's first test): the gateway's
    decision must still see it can pull (its KV bytes per block, 0 for an engine
    without a connector)."""
    doomed = scrape(peers["doomed"].url)
    assert doomed.get("pdfleet_engine_num_requests_running", 0) == 0
    assert (
        doomed["pdfleet_engine_kv_block_bytes"]
        == scrape(peers["holder"])["pdfleet_engine_kv_block_bytes"]
    )
    assert doomed["pdfleet_engine_kv_block_bytes"] > 0


def test_pull_from_a_peers_device_tier_is_token_identical(peers):
    body = body_of(1)
    complete(peers["holder"], {"prompt": body["prompt"][:200], "max_tokens": 1})
    text, blocks = pulled(peers, body, 200 // BLOCK)
    assert blocks == 200 // BLOCK
    assert text == recomputed(peers["puller"], body)


def test_pull_from_a_peers_host_tier_is_token_identical(peers):
    holder = peers["holder"]
    body = body_of(2)
    complete(holder, {"prompt": body["prompt"][:200], "max_tokens": 1})
    loaded = scrape(holder).get(LOADED, 0.0)
    # Other prompts take the 400 device blocks: the prefix lives on in the host tier.
    for seed in range(4):
        complete(holder, {"prompt": prompt_of(1900, 500 + seed), "max_tokens": 1})
    text, blocks = pulled(peers, body, 200 // BLOCK)
    assert blocks == 200 // BLOCK
    assert scrape(holder)[LOADED] > loaded  # lent from the host tier, through the device
    assert text == recomputed(peers["puller"], body)


def test_a_lend_at_a_busy_holder_is_answered_between_steps_computing_nothing(peers):
    """The holder decodes in its only slot with prompts queued behind it. A lend of
    blocks on its device tier runs in no step: the holder leases them between two
    of its steps, so its prompt-token counter does not move (its decode steps
    compute no prompt token, the queued prompts wait for the slot), and the answer
    has no token. Completions and chat alike; each pull is token-identical."""
    holder, puller = peers["holder"], peers["puller"]
    body = body_of(21)
    complete(holder, {"prompt": body["prompt"][:200], "max_tokens": 1})
    words = " ".join(f"w{i % 37} lend" for i in range(120))
    chat = {"messages": [{"role": "user", "content": words}], "max_tokens": 6, "temperature": 0}
    r = post(holder + "/v1/chat/completions", json={**chat, "max_tokens": 1}, timeout=60)
    assert r.status_code == 200, r.text
    chat_blocks = (r.json()["usage"]["prompt_tokens"] - 1) // BLOCK
    assert chat_blocks >= 4
    with HolderQueued(peers, peers["gateway"]):
        computed = scrape(holder)[PROMPT_TOKENS]
        r = lend(holder, body, 200 // BLOCK)
        assert r.status_code == 200, r.text
        answer = r.json()
        assert answer["choices"][0]["text"] == ""
        assert answer["usage"]["completion_tokens"] == 0
        assert answer["usage"]["prompt_tokens"] == len(body["prompt"])
        params = answer["kv_transfer_params"]
        assert len(params["remote_block_ids"]) == 200 // BLOCK
        r = post(
            holder + "/v1/chat/completions",
            timeout=60,
            json={
                **chat,
                "max_tokens": 1,
                "kv_transfer_params": {
                    "do_remote_decode": True,
                    "pdfleet_lend_blocks": chat_blocks,
                },
            },
        )
        assert r.status_code == 200, r.text
        chat_answer = r.json()
        assert chat_answer["choices"][0]["message"]["content"] == ""
        assert chat_answer["usage"]["completion_tokens"] == 0
        chat_params = chat_answer["kv_transfer_params"]
        assert len(chat_params["remote_block_ids"]) == chat_blocks
        assert scrape(holder)[PROMPT_TOKENS] == computed
        before = scrape(puller).get(PULLED, 0.0)
        text = complete(puller, body, kv_transfer_params=params)
        r = post(
            puller + "/v1/chat/completions",
            json={**chat, "kv_transfer_params": chat_params},
            timeout=120,
        )
        assert r.status_code == 200, r.text
        assert scrape(puller)[PULLED] - before == 200 // BLOCK + chat_blocks
    assert text == recomputed(puller, body)
    reference = post(
        puller + "/v1/chat/completions", json={**chat, "cache_salt": "reference"}, timeout=120
    )
    assert r.json()["choices"][0]["message"] == reference.json()["choices"][0]["message"]


# -- a prefill leg that pulls first (P/D) ------------------------------------------------
# The puller plays a prefill engine: it pulls the holder's lent prefix, computes the
# tail and leases the whole prompt to a decode leg, which the holder (kv_both) serves.


def prefill_after_pull(peers, body: dict, params: dict) -> dict:
    """The puller's prefill leg with the holder's lend params and ``pdfleet_produce``:
    its own signed params for the decode leg."""
    r = post(
        peers["puller"] + "/v1/completions",
        timeout=60,
        json={
            **body,
            "max_tokens": 1,
            "kv_transfer_params": {**params, "pdfleet_produce": True},
        },
    )
    assert r.status_code == 200, r.text
    out = r.json()["kv_transfer_params"]
    assert out["do_remote_prefill"] and "pdfleet_produce" not in out
    return out


def decoded_on_holder(peers, body: dict, params: dict) -> tuple[str, float]:
    """The decode leg on the holder: its text and the blocks it pulled from the puller."""
    before = scrape(peers["holder"]).get(PULLED, 0.0)
    text = complete(peers["holder"], body, kv_transfer_params=params)
    return text, scrape(peers["holder"]).get(PULLED, 0.0) - before


def test_a_prefill_leg_pulls_the_cached_prefix_and_lends_the_whole_prompt(peers):
    holder, puller = peers["holder"], peers["puller"]
    body = body_of(11)  # a 200-token prefix, a 60-token tail
    complete(holder, {"prompt": body["prompt"][:200], "max_tokens": 1})
    r = lend(holder, body, 200 // BLOCK)
    assert r.status_code == 200, r.text
    before = scrape(puller).get(PULLED, 0.0)
    params = prefill_after_pull(peers, body, r.json()["kv_transfer_params"])
    assert scrape(puller)[PULLED] - before == 200 // BLOCK  # the prefix came from the peer
    # The puller leases every full block before the last prompt token, pulled or not.
    assert len(params["remote_block_ids"]) == (len(body["prompt"]) - 1) // BLOCK
    assert params["remote_engine_id"] != r.json()["kv_transfer_params"]["remote_engine_id"]
    text, blocks = decoded_on_holder(peers, body, params)
    # The holder caches the prefix itself: it pulls the tail blocks the puller computed.
    assert blocks == (len(body["prompt"]) - 1) // BLOCK - 200 // BLOCK
    assert text == recomputed(puller, body)


def test_a_prefill_leg_whose_pull_fails_recomputes_and_still_lends(peers):
    holder, puller = peers["holder"], peers["puller"]
    body = body_of(12)
    complete(holder, {"prompt": body["prompt"][:200], "max_tokens": 1})
    r = lend(holder, body, 200 // BLOCK)
    assert r.status_code == 200, r.text
    lent = r.json()["kv_transfer_params"]
    # Another engine pulls the lease and confirms it (the lease ends there), so the
    # puller's claim of it is refused. (``doomed`` is killed by a later test.)
    complete(peers["doomed"].url, body, kv_transfer_params=lent)
    failures = scrape(puller).get("pdfleet_engine_kv_transfer_failures_total", 0.0)
    params = prefill_after_pull(peers, body, lent)
    assert scrape(puller)["pdfleet_engine_kv_transfer_failures_total"] > failures
    assert len(params["remote_block_ids"]) == (len(body["prompt"]) - 1) // BLOCK
    text, _ = decoded_on_holder(peers, body, params)
    assert text == recomputed(puller, body)
    # Params for another prompt (its chain differs): nothing is pulled, the puller
    # computes the prompt and still lends it.
    r = lend(holder, body, 200 // BLOCK)
    assert r.status_code == 200, r.text
    other = body_of(13)
    before = scrape(puller).get(PULLED, 0.0)
    params = prefill_after_pull(peers, other, r.json()["kv_transfer_params"])
    assert scrape(puller).get(PULLED, 0.0) == before
    # The lease was left to its lawful consumer: it is still there to pull.
    complete(peers["doomed"].url, body, kv_transfer_params=r.json()["kv_transfer_params"])
    text, blocks = decoded_on_holder(peers, other, params)
    assert blocks == (len(other["prompt"]) - 1) // BLOCK
    assert text == recomputed(puller, other)


def test_a_lend_of_blocks_the_holder_does_not_hold_is_refused(peers):
    before = scrape(peers["holder"]).get("pdfleet_engine_prompt_tokens_total", 0.0)
    r = lend(peers["holder"], body_of(3), 200 // BLOCK)  # never computed there
    assert r.status_code == 502, r.text
    assert "pdfleet_lend_blocks" in r.json()["error"]["message"]
    # Refused before any forward: a refused lend computes nothing on the holder.
    assert scrape(peers["holder"]).get("pdfleet_engine_prompt_tokens_total", 0.0) == before


def peer_gateway(engines_file, logs, mode: str = "Always"):
    """A gateway with peer pulls over the engines the file names (``mode``: its
    --disaggregation-mode)."""
    return start_gateway(
        [
            "--engines-file",
            str(engines_file),
            "--disaggregation-mode",
            mode,
            "--scrape-interval",
            "0.2",
            "--prefix-blocks",
            "256",
            "--kv-index-stale-after",
            "120",
            "--peer-pull",
            "--workers",
            "1",
        ],
        logs,
    )


@pytest.fixture(scope="module")
def pd_gateway(peers):
    """A second gateway over the same engines as a P/D fleet: the holder and the
    puller are its prefill engines, ``doomed`` its decode engine (so this runs
    before the tests that kill them: the holder, then ``doomed``)."""
    logs = peers["logs"]
    engines_file = logs / "pd-engines.json"
    engines_file.write_text(
        json.dumps(
            {
                "engines": [
                    *(
                        {
                            "url": peers[name],
                            "role": "prefill",
                            "kv_events": f"tcp://127.0.0.1:{peers['events'][name][0]}",
                            "kv_events_replay": f"tcp://127.0.0.1:{peers['events'][name][1]}",
                        }
                        for name in ("holder", "puller")
                    ),
                    {"url": peers["doomed"].url, "role": "decode"},
                ]
            }
        )
    )
    gateway = peer_gateway(engines_file, logs)
    try:
        yield gateway.url
    finally:
        gateway.stop()


PD_PREFIX = 1024
"""The P/D gateway's prefixes: 64 blocks, worth its first pull of the pair (explore)."""


class HolderQueued:
    """The holder busy with one long decode (its only slot) and ``tokens`` prompt
    tokens queued behind it, all sent to it directly: serving a prompt there waits
    for them, a lend does not (it jumps the queue). The queued prompts are one
    prompt the holder caches, three times: they count in full as queued tokens
    and cost little to run once the decode is dropped."""

    def __init__(self, peers, gateway: str, tokens: int = 3000) -> None:
        self.holder = peers["holder"]
        self.killed = False
        """Set when a test killed the holder: nothing is left to drain."""
        queued = {"prompt": prompt_of(tokens // 3, 960), "max_tokens": 1}
        complete(self.holder, queued)
        self.pool = ThreadPoolExecutor(4)
        self.client = httpx.Client(headers=fleet_headers(), timeout=120)
        self.stop = threading.Event()
        self.futures = [self.pool.submit(self._decode)]
        assert wait_until(
            lambda: scrape(self.holder).get("pdfleet_engine_num_requests_running", 0) == 1,
            timeout=60,
        )
        for _ in range(3):
            self.futures.append(self.pool.submit(self._post, queued))
        assert wait_until(
            lambda: engine_view(gateway, self.holder)["queued_prompt_tokens"] >= tokens - 3,
            timeout=60,
        ), engine_view(gateway, self.holder)

    def _post(self, body: dict) -> int:
        return self.client.post(self.holder + "/v1/completions", json=body).status_code

    def _decode(self) -> None:
        """A long streamed decode, dropped (the engine aborts it) once ``stop`` is set."""
        long = {"prompt": prompt_of(8, 950), "max_tokens": 2048, "ignore_eos": True}
        with self.client.stream(
            "POST", self.holder + "/v1/completions", json={**long, "stream": True}
        ) as r:
            for _ in r.iter_lines():
                if self.stop.is_set():
                    return

    def __enter__(self) -> HolderQueued:
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()  # the queued prompts run once the decode is dropped
        self.pool.shutdown(wait=True)
        self.client.close()
        if self.killed:
            return
        assert wait_until(
            lambda: (
                scrape(self.holder).get("pdfleet_engine_num_requests_running", 0)
                + scrape(self.holder).get("pdfleet_engine_num_requests_waiting", 0)
                == 0
            ),
            timeout=60,
        )


def decisions(gateway: str, decision: str, reason: str) -> float:
    return metric(gateway, DECISIONS, decision=decision, reason=reason)


def counted(gateway: str) -> dict:
    """Every decision the gateway counted, by (decision, reason)."""
    return {
        (d, r): decisions(gateway, d, r)
        for d in ("holder", "pull", "recompute")
        for r in ("cost", "explore", "lend_refused", "lend_failed")
    }


def engine_view(gateway: str, url: str) -> dict:
    return next(e for e in engines_view(gateway)["engines"] if e["url"] == url)["peer_pull"]


def pin(seed: int) -> list[int]:
    """A prefix for :class:`Busy`, cached on the holder only (``primed`` first: the
    gateway's router sends a request that starts with it there)."""
    return prompt_of(64, seed)


class Busy:
    """The holder at the gateway's capacity for it, so serving there is not an
    option and the gateway chooses between pulling and recomputing alone: one long
    decode in the holder's only slot, sent through the gateway (its router sends
    it to the engine that caches ``pinned``; ``prompt_logprobs`` keeps the peer-pull
    decision out of it), and short prompts queued behind it sent to the holder
    directly.
    The holder queues while the gateway has one request there, so the gateway
    learns its capacity as one and counts it full."""

    def __init__(
        self,
        peers,
        pinned: list[int],
        queued: int = 4,
        step_delay: float = 0.0,
        decode_tokens: int = 512,
    ) -> None:
        self.peers = peers
        # Every holder step first sleeps this long (the step-delay test hook):
        # the step a lend waits for, so the crossover at the busy holder is set
        # by it rather than by this machine's load.
        peers["step_delay"].write_text(str(step_delay))
        gw, holder = peers["gateway"], peers["holder"]
        self.pool = ThreadPoolExecutor(1 + queued)
        self.client = httpx.Client(headers=fleet_headers(), timeout=120)
        complete(holder, {"prompt": pinned, "max_tokens": 1})  # kept fresh in its cache
        long = {
            "prompt": [*pinned, 7],
            # Long enough to outlast a decision (with undelayed steps, take more),
            # short enough that its blocks and a prefix of MAX_LEN fit the holder's
            # device blocks together.
            "max_tokens": decode_tokens,
            "ignore_eos": True,
            "prompt_logprobs": 0,
        }
        # The router sends it to the holder once the index has the pin; the pin was
        # just refreshed there (recomputed if it had been evicted), and its event may
        # still be on the way: a decode the router sent elsewhere is aborted, and
        # sent again (the index has the event by then).
        for _ in range(5):
            self.gw_client = httpx.Client(timeout=120)
            self.futures = [self.pool.submit(self._post, self.gw_client, gw, long)]
            assert wait_until(lambda: self._admitted() > 0, timeout=60), engines_view(gw)
            if self._view()["admitted"] == 1:
                break
            self.gw_client.close()
            assert wait_until(lambda: self._admitted() == 0, timeout=60), engines_view(gw)
        assert self._view()["admitted"] == 1, engines_view(gw)
        for i in range(queued):
            self.futures.append(
                self.pool.submit(
                    self._post,
                    self.client,
                    holder,
                    {"prompt": prompt_of(32, 900 + i), "max_tokens": 1},
                )
            )

    def _admitted(self) -> int:
        return sum(e["admitted"] for e in engines_view(self.peers["gateway"])["engines"])

    def _view(self) -> dict:
        gw, holder = self.peers["gateway"], self.peers["holder"]
        return next(e for e in engines_view(gw)["engines"] if e["url"] == holder)

    @staticmethod
    def _post(client: httpx.Client, url: str, body: dict) -> int:
        return client.post(url + "/v1/completions", json=body).status_code

    def __enter__(self) -> Busy:
        def full() -> bool:
            view = self._view()
            return view["capacity"] is not None and view["admitted"] >= view["capacity"]

        assert wait_until(full, timeout=60), self._view()
        return self

    def __exit__(self, *exc) -> None:
        # Closing the clients aborts the long decode and the queued prompts.
        self.peers["step_delay"].write_text("0")
        self.client.close()
        self.gw_client.close()
        self.pool.shutdown(wait=True, cancel_futures=True)
        holder = self.peers["holder"]
        assert wait_until(
            lambda: (
                scrape(holder).get("pdfleet_engine_num_requests_running", 0)
                + scrape(holder).get("pdfleet_engine_num_requests_waiting", 0)
                == 0
            ),
            timeout=60,
        )


def measured(peers, gateway: str | None = None) -> None:
    """Both engines' prefill rates known to the gateway."""
    gw = gateway or peers["gateway"]
    for seed, url in enumerate((peers["holder"], peers["puller"])):
        if engine_view(gw, url)["prefill_tokens_per_s"] is None:
            complete(url, {"prompt": prompt_of(600, 7100 + seed), "max_tokens": 1})
    assert wait_until(
        lambda: all(
            engine_view(gw, u)["prefill_tokens_per_s"] for u in (peers["holder"], peers["puller"])
        ),
        timeout=30,
    )


def via_gateway(gateway: str, body: dict) -> str:
    r = httpx.post(gateway + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def primed(peers, tokens: list[int], gateway: str | None = None) -> None:
    """``tokens`` cached on the holder and stored in the gateway's index."""
    gw, holder = gateway or peers["gateway"], peers["holder"]
    before = metric(gw, "pdfleet_gateway_kv_index_events_total", engine=holder)
    complete(holder, {"prompt": tokens, "max_tokens": 1})
    assert wait_until(
        lambda: metric(gw, "pdfleet_gateway_kv_index_events_total", engine=holder) > before,
        timeout=30,
    )


CROSSOVER = "pdfleet_gateway_peer_pull_crossover_tokens"
BANDWIDTH = "pdfleet_gateway_peer_pull_bandwidth_bytes_per_second"
MARGIN = 2.0
"""How far from the crossover (a factor) each side's prefix length lies."""


def settled_crossover(gw: str, holder: str, puller: str) -> float:
    """The pair's crossover once nothing moves it: three reads, scrapes apart, agree
    (its figures change only with new samples: the engines' prefills, pulls, lends)."""
    reads: list[float] = []

    def steady() -> bool:
        reads.append(metric(gw, CROSSOVER, holder=holder, puller=puller))
        measured = metric(gw, BANDWIDTH, holder=holder, puller=puller) > 0
        return measured and len(reads) >= 3 and reads[-1] == reads[-2] == reads[-3]

    assert wait_until(steady, timeout=60, interval=0.5), reads[-5:]
    # +Inf: pulling never wins here (the measured bandwidth is below the prefill rate).
    assert math.isfinite(reads[-1]), reads[-1]
    return reads[-1]


def test_gateway_pulls_or_recomputes_on_either_side_of_the_measured_crossover(peers):
    gw, holder, puller = peers["gateway"], peers["holder"], peers["puller"]
    measured(peers)
    # One pull straight between the two first: the pair's first READ sets up its
    # connection, which the gateway's first measured pull must not pay.
    warm = body_of(5)
    complete(holder, {"prompt": warm["prompt"][:200], "max_tokens": 1})
    pulled(peers, warm, 200 // BLOCK)
    explore = prompt_of(1024, 4242)
    primed(peers, explore)
    pinned = pin(8888)
    primed(peers, pinned)
    tail = prompt_of(40, 99)
    with Busy(peers, pinned, decode_tokens=2048):
        # No pair measured yet: the first long prefix is pulled to measure it.
        body = {"prompt": explore + tail, "max_tokens": 6, "temperature": 0, "ignore_eos": True}
        explored = decisions(gw, "pull", "explore")
        before = scrape(puller).get(PULLED, 0.0)
        assert via_gateway(gw, body) == recomputed(puller, body)
        assert decisions(gw, "pull", "explore") == explored + 1
        assert scrape(puller)[PULLED] - before == 1024 // BLOCK
    # With the holder at capacity the choice is the puller's alone: pull iff the
    # prefix is longer than the crossover at the busy holder, (lend(h) + step(h))
    # over the per-token margin (1/rate(c) - bytes per token / bw(h, c)). The
    # holder's steps each sleep STEP_DELAY, so step(h) dominates the lend and the
    # crossover sits far inside the model's length whatever this machine's load;
    # each side's prefix lies MARGIN times from it, computed from the gateway's
    # figures read in the state the decision sees (nothing measured of the pair
    # moves in between: the puller is idle, the holder's step has settled).
    settled_crossover(gw, holder, puller)
    assert metric(gw, "pdfleet_gateway_peer_pull_fleet_crossover_tokens") >= 0
    mid = prompt_of(1024, 3002)
    primed(peers, mid)
    longest = prompt_of(MAX_LEN - 2 * len(tail), 3001)
    primed(peers, longest)
    with Busy(peers, pinned, step_delay=STEP_DELAY):
        crossover = busy_crossover(peers)
        blocks = min(len(mid) // BLOCK, math.floor(crossover / MARGIN / BLOCK))
        assert blocks > 0, (crossover, engines_view(gw))
        decided(peers, mid[: blocks * BLOCK] + tail, "recompute", 0, crossover)
    settled_crossover(gw, holder, puller)
    with Busy(peers, pinned, step_delay=STEP_DELAY):
        crossover = busy_crossover(peers)
        blocks = math.ceil(crossover * MARGIN / BLOCK)
        assert blocks * BLOCK <= len(longest), (crossover, engines_view(gw))
        decided(peers, longest[: blocks * BLOCK] + tail, "pull", blocks, crossover)


STEP_DELAY = 0.02


def busy_crossover(peers) -> float:
    """The pair's crossover in tokens at the busy holder, from the gateway's own
    figures, once the holder's step time has settled on its delayed decode steps
    (an average over scrapes: longer steps before, such as a long prefill's, leave
    it slowly)."""
    gw, holder, puller = peers["gateway"], peers["holder"], peers["puller"]
    steps: list[float] = []

    def settled() -> bool:
        steps.append(engine_view(gw, holder)["step_s"] or 0.0)
        last = steps[-4:]
        return len(last) == 4 and min(last) >= 0.8 * STEP_DELAY and max(last) <= 1.2 * min(last)

    assert wait_until(settled, timeout=60, interval=0.3), steps[-8:]
    h, p = engine_view(gw, holder), engine_view(gw, puller)
    bw = metric(gw, BANDWIDTH, holder=holder, puller=puller)
    margin = 1 / p["prefill_tokens_per_s"] - h["kv_block_bytes"] / BLOCK / bw
    assert margin > 0, (h, p, bw)
    return (h["lend_s"] + h["step_s"]) / margin


def decided(peers, prompt: list[int], decision: str, blocks: int, crossover: float) -> None:
    """The gateway serves ``prompt`` by ``decision`` (its cost), pulling ``blocks``,
    token-identical to computing it from scratch."""
    gw, puller = peers["gateway"], peers["puller"]
    body = {"prompt": prompt, "max_tokens": 6, "temperature": 0}
    counted = decisions(gw, decision, "cost")
    before = scrape(puller).get(PULLED, 0.0)
    assert via_gateway(gw, body) == recomputed(puller, body)
    assert decisions(gw, decision, "cost") == counted + 1, (
        len(prompt),
        crossover,
        {d: decisions(gw, d, "cost") for d in ("holder", "pull", "recompute")},
        {r: decisions(gw, "recompute", r) for r in ("lend_refused", "lend_failed")},
        engines_view(gw),
    )
    assert scrape(puller)[PULLED] - before == blocks


def test_gateway_recomputes_when_the_holder_evicted_what_its_index_saw(peers, pd_gateway):
    gw, holder, puller = peers["gateway"], peers["holder"], peers["puller"]
    measured(peers)
    measured(peers, pd_gateway)
    # Primed first, so evicted first: the P/D gateway's prefix.
    gone_pd = prompt_of(PD_PREFIX, 5252)
    primed(peers, gone_pd, pd_gateway)
    gone = prompt_of(MAX_LEN - 80, 5151)
    primed(peers, gone)
    pinned = pin(8889)
    primed(peers, pinned)  # in the index before it stops seeing events (Busy routes by it)
    peers["forwarder"].open.clear()  # the index keeps seeing the blocks
    try:
        # Other prompts take the device blocks and the host tier: `gone` leaves both.
        for seed in range(8):
            complete(holder, {"prompt": prompt_of(1900, 6000 + seed), "max_tokens": 1})
        with Busy(peers, pinned, step_delay=STEP_DELAY):
            # A prefix long enough that the pair's crossover at the busy holder (once
            # measured; before, a first pull explores) says pull: the lend is asked
            # for, and refused.
            blocks = 1536 // BLOCK
            if metric(gw, BANDWIDTH, holder=holder, puller=puller) > 0:
                crossover = busy_crossover(peers)
                blocks = max(blocks, math.ceil(crossover * MARGIN / BLOCK))
                assert blocks * BLOCK <= len(gone), (crossover, engines_view(gw))
            body = {
                "prompt": gone[: blocks * BLOCK] + prompt_of(40, 98),
                "max_tokens": 6,
                "temperature": 0,
            }
            refused = decisions(gw, "recompute", "lend_refused")
            assert via_gateway(gw, body) == recomputed(puller, body)
            assert decisions(gw, "recompute", "lend_refused") == refused + 1
        # The same in P/D: the prefill engine the decision picks would pull the
        # prefix from the busy holder; the lend is refused and it runs the plain leg.
        with HolderQueued(peers, pd_gateway):
            body = {"prompt": gone_pd + prompt_of(40, 96), "max_tokens": 6, "temperature": 0}
            refused = decisions(pd_gateway, "recompute", "lend_refused")
            assert via_gateway(pd_gateway, body) == recomputed(puller, body)
            assert decisions(pd_gateway, "recompute", "lend_refused") == refused + 1, (
                counted(pd_gateway),
                [e["peer_pull"] for e in engines_view(pd_gateway)["engines"]],
            )
    finally:
        peers["forwarder"].open.set()
    assert not math.isnan(metric(gw, "pdfleet_gateway_peer_pull_fleet_crossover_tokens"))


def test_a_pd_gateway_has_its_prefill_engine_pull_the_prefix_from_a_busy_holder(peers, pd_gateway):
    gw, puller, decode = pd_gateway, peers["puller"], peers["doomed"]
    measured(peers, gw)
    prefix = prompt_of(PD_PREFIX, 4343)
    primed(peers, prefix, gw)
    body = {
        "prompt": prefix + prompt_of(40, 97),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    with HolderQueued(peers, gw):
        # Serving the prefill leg on the holder waits for its queue; the other
        # prefill engine pulls the prefix (the first pull of the pair: explore),
        # computes the tail, and the decode engine pulls the whole prompt from it.
        pulls = decisions(gw, "pull", "explore") + decisions(gw, "pull", "cost")
        into_prefill = scrape(puller).get(PULLED, 0.0)
        into_decode = scrape(decode.url).get(PULLED, 0.0)
        text = via_gateway(gw, body)
        assert decisions(gw, "pull", "explore") + decisions(gw, "pull", "cost") == pulls + 1, (
            counted(gw),
            [e["peer_pull"] for e in engines_view(gw)["engines"]],
        )
    assert scrape(puller)[PULLED] - into_prefill == len(prefix) // BLOCK
    assert scrape(decode.url)[PULLED] - into_decode == (len(body["prompt"]) - 1) // BLOCK
    assert text == recomputed(puller, body)
    prefix = prompt_of(256, 4344)
    primed(peers, prefix, gw)

    # The holder idle again, as the gateway sees it (nothing queued, no step in
    # progress at its last scrape, which may have come while it cached the new
    # prefix), healthy and with a free slot (its one slot held a long decode and
    # a queue: a stall's ejection or the learned capacity could still leave it
    # out): its prefill leg is the cheapest (a pull would add the lend, now
    # measured), so the leg runs there.
    def holder_idle() -> bool:
        whole = next(e for e in engines_view(gw)["engines"] if e["url"] == peers["holder"])
        view = whole["peer_pull"]
        free = whole["capacity"] is None or whole["admitted"] < whole["capacity"]
        idle = view["queued_prompt_tokens"] == 0 and view["step_wait_s"] == 0
        return idle and free and whole["state"] == "healthy" and not whole["stalled"]

    assert wait_until(holder_idle, timeout=30), engines_view(gw)
    body = {**body, "prompt": prefix + prompt_of(40, 97)}
    served = decisions(gw, "holder", "cost")
    pulled = decisions(gw, "pull", "cost")
    rates = {e["url"]: e["peer_pull"]["prefill_tokens_per_s"] for e in engines_view(gw)["engines"]}
    computed = {u: scrape(u).get(PROMPT_TOKENS, 0.0) for u in (peers["holder"], puller)}
    text = via_gateway(gw, body)
    message = (
        f"decisions made: { ({k: v for k, v in counted(gw).items() if v}) }; "
        f"engines: {engines_view(gw)['engines']}"
    )
    if decisions(gw, "holder", "cost") == served + 1:
        assert scrape(peers["holder"])[PROMPT_TOKENS] > computed[peers["holder"]]
        assert scrape(puller).get(PROMPT_TOKENS, 0.0) == computed[puller]
        assert text == recomputed(puller, body)
    else:
        # The costs are the engines' measured rates: on a loaded machine the
        # holder can measure slower than the puller by more than the lend
        # costs, and a pull is then the cheaper leg (never without that).
        assert decisions(gw, "pull", "cost") == pulled + 1, message
        assert rates[peers["holder"]] < rates[puller], message
        assert text == recomputed(puller, body)


# -- a holder killed mid-pull ----------------------------------------------------------


@pytest.fixture(scope="module")
def pd_lender_gateway(peers):
    """A P/D gateway over the same engines where the holder is the decode engine
    (kv_both, as ``spec.prefill.peerPull`` makes it) and the puller the prefill
    engine: what the holder decodes (a conversation's last turn) it lends to the
    puller's prefill legs."""
    logs = peers["logs"] / "pd-lender"
    logs.mkdir()
    engines_file = logs / "engines.json"
    engines_file.write_text(
        json.dumps(
            {
                "engines": [
                    {
                        "url": peers[name],
                        "role": role,
                        "kv_events": f"tcp://127.0.0.1:{peers['events'][name][0]}",
                        "kv_events_replay": f"tcp://127.0.0.1:{peers['events'][name][1]}",
                    }
                    for name, role in (("puller", "prefill"), ("holder", "decode"))
                ]
            }
        )
    )
    gateway = peer_gateway(engines_file, logs)
    try:
        yield gateway.url
    finally:
        gateway.stop()


def chat_of(n: int, seed: int) -> list[int]:
    """Tokens no other test's prompt starts with (``prompt_of`` repeats every 1,700
    seeds, and its prompts may still be cached on the engines)."""
    return [(seed * 7 + i * i * 13) % 1700 + 20 for i in range(n)]


def next_turn(peers, gw: str, seed: int, answer: int) -> tuple[dict, int]:
    """A conversation's turn through the P/D gateway (prefilled by the puller,
    decoded by the holder) and the next turn's body, which extends its prompt
    with its answer and a new message; and the leading blocks the holder holds
    of it (the turn's prompt and answer but the answer's last token)."""
    holder, puller = peers["holder"], peers["puller"]
    prompt = chat_of(64, seed)
    events = metric(gw, "pdfleet_gateway_kv_index_events_total", engine=holder)
    computed = scrape(puller).get(PROMPT_TOKENS, 0.0)
    r = httpx.post(
        gw + "/v1/completions",
        timeout=120,
        json={
            "prompt": prompt,
            "max_tokens": answer,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    said = r.json()["choices"][0]["token_ids"]
    assert len(said) == answer
    assert scrape(puller)[PROMPT_TOKENS] - computed == len(prompt)  # its prefill leg
    # The holder's blocks, pulled and decoded, are in the gateway's index.
    assert wait_until(
        lambda: metric(gw, "pdfleet_gateway_kv_index_events_total", engine=holder) > events,
        timeout=30,
    )
    body = {
        "prompt": prompt + said + chat_of(40, seed + 1),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    return body, (len(prompt) + answer - 1) // BLOCK


def test_a_prefill_leg_pulls_the_prefix_a_decode_engine_holds(peers, pd_lender_gateway):
    """Multi-turn chat in P/D: the decode engine holds the last turn's prompt and
    answer, the prefill engine only the prompt. With the decode engine's queue long,
    the prefill leg pulls the answer's blocks from it, computes the new message and
    leases the whole prompt to the decode engine, which pulls the tail back;
    token-identical to computing the prompt from scratch."""
    gw, holder, puller = pd_lender_gateway, peers["holder"], peers["puller"]
    # Both engines' prefill rates measured by this gateway, from prompts new to them.
    for seed, url in enumerate((holder, puller)):
        complete(url, {"prompt": chat_of(600, 7710 + seed), "max_tokens": 1})
    assert wait_until(
        lambda: all(engine_view(gw, u)["prefill_tokens_per_s"] for u in (holder, puller)),
        timeout=30,
    ), engines_view(gw)
    # A long answer: the pull beats recomputing it by far more than the holder's
    # step in progress (which a lend waits for), whatever this machine's load.
    body, held = next_turn(peers, gw, 7700, answer=384)
    own = 64 // BLOCK  # the puller prefilled the first turn's prompt
    leased = (len(body["prompt"]) - 1) // BLOCK
    into_prefill = scrape(puller).get(PULLED, 0.0)
    into_decode = scrape(holder).get(PULLED, 0.0)
    before = counted(gw)
    with ThreadPoolExecutor(1) as pool:
        with HolderQueued(peers, gw):
            # The decode leg waits in the holder's queue: the decision is made (and a
            # pull's lend answered, ahead of that queue) before the queue is let go.
            answer = pool.submit(via_gateway, gw, body)
            assert wait_until(lambda: counted(gw) != before, timeout=60), counted(gw)
            decided = {k: v - before[k] for k, v in counted(gw).items() if v != before[k]}
            assert decided in ({("pull", "explore"): 1}, {("pull", "cost"): 1}), (
                decided,
                [e["peer_pull"] for e in engines_view(gw)["engines"]],
            )
        text = answer.result(timeout=120)
    assert scrape(puller)[PULLED] - into_prefill == held - own  # what only the holder had
    assert scrape(holder)[PULLED] - into_decode == leased - held  # the tail, back
    assert text == recomputed(puller, body)


def test_a_pd_prefill_leg_whose_holder_is_killed_mid_pull_recomputes_and_still_lends(
    peers, pd_gateway
):
    """Through the P/D gateway: the prefill leg goes to the puller, which pulls the
    prefix from the (busy) holder; the holder is killed while the READ is in flight.
    The puller computes the whole prompt and still leases it to the decode engine:
    the client's answer is the plain computation's. (The holder stays dead: the
    module's later tests use the puller and ``doomed`` only.)"""
    gw, puller, decode = pd_gateway, peers["puller"], peers["doomed"]
    measured(peers, gw)
    # Twice the other P/D tests' prefix: the pull (the pair is measured by now, so
    # the decision weighs its cost) wins over recomputing by a wide margin.
    prefix = prompt_of(2 * PD_PREFIX, 4545)
    primed(peers, prefix, gw)
    body = {
        "prompt": prefix + prompt_of(40, 95),
        "max_tokens": 6,
        "temperature": 0,
        "ignore_eos": True,
    }
    pulls = decisions(gw, "pull", "explore") + decisions(gw, "pull", "cost")
    failures = scrape(puller).get("pdfleet_engine_kv_transfer_failures_total", 0.0)
    computed = scrape(puller).get(PROMPT_TOKENS, 0.0)
    into_decode = scrape(decode.url).get(PULLED, 0.0)
    queued = HolderQueued(peers, gw)
    try:
        peers["delay"].write_text("1.5")  # the puller's READ waits: kill the holder meanwhile
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(via_gateway, gw, body)
            assert wait_until(
                lambda: (
                    fut.done() or scrape(puller).get("pdfleet_engine_kv_pulls_in_flight", 0) > 0
                ),
                timeout=30,
                interval=0.02,
            )
            assert not fut.done(), (  # answered without a pull: the decision did not pull
                counted(gw),
                [e["peer_pull"] for e in engines_view(gw)["engines"]],
            )
            os.kill(peers["holder_proc"].proc.pid, signal.SIGKILL)
            queued.killed = True
            text = fut.result(timeout=60)
    finally:
        peers["delay"].write_text("0")
        queued.__exit__(None, None, None)
    assert decisions(gw, "pull", "explore") + decisions(gw, "pull", "cost") == pulls + 1
    assert scrape(puller)["pdfleet_engine_kv_transfer_failures_total"] > failures
    # The puller computed the whole prompt (nothing of it was pulled) ...
    assert scrape(puller)[PROMPT_TOKENS] - computed == len(body["prompt"])
    # ... and leased all of it: the decode engine pulled every full block from it.
    assert scrape(decode.url)[PULLED] - into_decode == (len(body["prompt"]) - 1) // BLOCK
    assert text == recomputed(puller, body)


def test_holder_killed_mid_pull_recomputes_correctly(peers):
    doomed = peers["doomed"]
    body = body_of(4)
    try:
        complete(doomed.url, {"prompt": body["prompt"][:200], "max_tokens": 1})
        r = lend(doomed.url, body, 200 // BLOCK)
        assert r.status_code == 200, r.text
        params = r.json()["kv_transfer_params"]
        failures = scrape(peers["puller"]).get("pdfleet_engine_kv_transfer_failures_total", 0.0)
        peers["delay"].write_text("1.5")  # the READ waits: kill the holder meanwhile
        with ThreadPoolExecutor(1) as pool:
            fut = pool.submit(complete, peers["puller"], body, kv_transfer_params=params)
            assert wait_until(
                lambda: scrape(peers["puller"]).get("pdfleet_engine_kv_pulls_in_flight", 0) > 0,
                timeout=30,
                interval=0.02,
            )
            os.kill(doomed.proc.pid, signal.SIGKILL)
            text = fut.result(timeout=60)
    finally:
        peers["delay"].write_text("0")
    assert scrape(peers["puller"])["pdfleet_engine_kv_transfer_failures_total"] > failures
    assert text == recomputed(peers["puller"], body)


# -- P/D: a decode engine lends what it decoded ------------------------------------------
