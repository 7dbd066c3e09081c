"""vLLM's own P/D router drives pdfleet engines with an internal key, not a client key.

``vllm-router --vllm-pd-disaggregation`` sends ``$OPENAI_API_KEY`` to the
workers and passes the prefill leg's ``kv_transfer_params`` to the decode leg
unchanged. Engines accept those params only from internal callers: an
internal key (``$PDFLEET_INTERNAL_API_KEY``) works, a client key does not.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import httpx
from helpers.security_pair import CLIENT_KEY, INTERNAL_KEY, post, prompt, text_of
from helpers.server import free_port, wait_until
from helpers.vllm_router import install_vllm_router

TRANSFERS = "pdfleet_engine_kv_transfers_total"


def run_router(binary: Path, pair, key: str, log: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    args = [
        str(binary),
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--vllm-pd-disaggregation",
        "--prefill",
        pair.prefill.url,
        "--decode",
        pair.decode.url,
        "--policy",
        "round_robin",
        "--kv-connector",
        "nixl",
        "--prometheus-port",
        str(free_port()),
        "--worker-startup-check-interval",
        "1",
    ]
    with open(log, "wb") as out:
        proc = subprocess.Popen(
            args,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, "OPENAI_API_KEY": key, "NO_COLOR": "1"},
        )
    url = f"http://127.0.0.1:{port}"

    def up() -> bool:
        try:
            return httpx.get(url + "/health", timeout=2).status_code == 200
        except httpx.HTTPError:
            return proc.poll() is not None

    assert wait_until(up, 60) and proc.poll() is None, log.read_text(errors="replace")[-3000:]
    return proc, url


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(10)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait(10)


def test_vllm_router_drives_pd_with_an_internal_key_and_not_with_a_client_key(pair, tmp_path):
    binary = install_vllm_router()
    body = {"prompt": prompt(9601), "max_tokens": 8, "temperature": 0, "ignore_eos": True}
    want = text_of(post(pair.prefill.url + "/v1/completions", body))
    for key, works in ((INTERNAL_KEY, True), (CLIENT_KEY, False)):
        proc, url = run_router(binary, pair, key, tmp_path / f"router-{works}.log")
        try:
            before = pair.metric("decode", TRANSFERS)
            r = httpx.post(url + "/v1/completions", json=body, timeout=120)
            if works:
                assert text_of(r) == want
                # The decode engine pulled the prompt's KV: a real P/D transfer.
                assert pair.metric("decode", TRANSFERS) == before + 1
            else:
                assert r.status_code != 200, r.text
                assert pair.metric("decode", TRANSFERS) == before
        finally:
            stop(proc)
