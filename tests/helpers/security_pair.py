"""A prefill/decode pair for the security tests (tests/security/conftest.py starts it).

Both engines run as real processes with what a fleet gives them: the fleet
secret, an identity of their own (key + token signed by the test's identity
authority, as ``pdfleet up`` and the operator do), a client API key (direct
engine access) and an internal key (what vLLM's router presents). The
decode engine renders chats with another template than the prefill engine
(an honest skew between the roles); completions are unaffected by it. The
prefill engine publishes KV events with the defaults a fleet gets (auth
``fleet``, no token ids, ``*`` bound to the KV address).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import httpx

from pdfleet.engine.contracts import identity

from .server import ServerProcess, fleet_headers, free_port, scrape

MAX_LEN = 512
CLIENT_KEY = "client-key-0123456789"
INTERNAL_KEY = "internal-key-0123456789"
# The decode engine's chat template: the same messages, other tokens.
SKEWED_TEMPLATE = (
    "{% for m in messages %}### {{ m['role'] }} says: {{ m['content'] }}\n{% endfor %}"
    "### assistant says:"
)


@dataclass
class Pair:
    connector: str
    prefill: ServerProcess
    decode: ServerProcess
    kv_ports: dict[str, int]
    events_port: int
    authority: identity.Authority
    tmp: Path

    def metric(self, role: str, name: str) -> float:
        return scrape(getattr(self, role).url).get(name, 0.0)

    def wait_healthy(self) -> Pair:
        """Both engines healthy (both stopped again if either fails to start)."""
        try:
            self.prefill.wait_healthy()
            self.decode.wait_healthy()
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        self.prefill.stop()
        self.decode.stop()


def identity_env(authority: identity.Authority, tmp: Path, name: str, role: str) -> dict:
    path = tmp / f"{name}.identity.json"
    identity.EngineIdentity.issue(authority, f"sec/{name}", role, "sec", 3600).write(path)
    return {
        identity.IDENTITY_FILE_ENV: str(path),
        identity.IDENTITY_AUTHORITY_ENV: authority.public_key,
    }


def kv_config(connector: str, role: str, port: int, **extra) -> list[str]:
    cfg = {"kv_connector": connector, "kv_role": role, "kv_port": port, "kv_ip": "127.0.0.1"}
    # Short leases: a prefill engine stops only once its leases are claimed or expired.
    cfg["kv_connector_extra_config"] = {"lease_seconds": 8, **extra}
    return ["--kv-transfer-config", json.dumps(cfg)]


def start_pair(connector: str, model: str, tmp: Path) -> Pair:
    """Both engines, healthy (stopped again if either fails to start)."""
    return launch_pair(connector, model, tmp).wait_healthy()


def launch_pair(connector: str, model: str, tmp: Path) -> Pair:
    """Both engines, started (not yet waited for: :meth:`Pair.wait_healthy`)."""
    authority = identity.Authority.generate()
    kv_ports = {"prefill": free_port(), "decode": free_port()}
    events_port = free_port()
    keys = {"PDFLEET_API_KEY": CLIENT_KEY, "PDFLEET_INTERNAL_API_KEY": INTERNAL_KEY}
    common = ["--max-model-len", str(MAX_LEN), "--disable-log-stats"]
    events = {"enable_kv_cache_events": True, "endpoint": f"tcp://*:{events_port}"}
    prefill = ServerProcess(
        [
            "serve",
            model,
            *common,
            *kv_config(connector, "kv_producer", kv_ports["prefill"]),
            "--kv-events-config",
            json.dumps(events | {"heartbeat_interval": 0.2}),
        ],
        tmp,
        "prefill",
        env={**keys, **identity_env(authority, tmp, "prefill", "prefill")},
    )
    template = tmp / "skewed.jinja"
    template.write_text(SKEWED_TEMPLATE)
    decode = ServerProcess(
        [
            "serve",
            model,
            *common,
            *kv_config(connector, "kv_consumer", kv_ports["decode"]),
            "--chat-template",
            str(template),
        ],
        tmp,
        "decode",
        env={**keys, **identity_env(authority, tmp, "decode", "decode")},
    )
    return Pair(connector, prefill, decode, kv_ports, events_port, authority, tmp)


def post(url: str, body: dict, key: str | None = None) -> httpx.Response:
    """POST with ``key`` as the bearer (default: the fleet token, as the gateway sends)."""
    headers = {"authorization": f"Bearer {key}"} if key else fleet_headers()
    return httpx.post(url, json=body, headers=headers, timeout=120)


def prefill_leg(pair: Pair, body: dict, endpoint: str = "/v1/completions") -> dict:
    """The gateway's prefill leg: the producer's signed kv_transfer_params."""
    r = post(
        pair.prefill.url + endpoint,
        {
            **body,
            "max_tokens": 1,
            "stream": False,
            "kv_transfer_params": {"do_remote_decode": True},
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["kv_transfer_params"]


def text_of(r: httpx.Response) -> str:
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    return choice["text"] if "text" in choice else choice["message"]["content"]


def prompt(seed: int, n: int = 100) -> list[int]:
    """A token-id prompt of exactly ``n`` tokens (6 full blocks of 16 for 100)."""
    return [(seed * 131 + i * 17) % 1700 + 20 for i in range(n)]
