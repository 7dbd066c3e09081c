"""`pdfleet up`: engines take no client key, identities per engine, owner-only run files.

Before, every engine of a local fleet accepted the client API keys (so one key
was enough for the cross-prompt injection) and the engines file, which lists
every port, was world-readable.
"""

from __future__ import annotations

import json
import stat

import httpx
import pytest
from helpers.security_pair import CLIENT_KEY, prompt
from helpers.server import fleet_headers, scrape
from helpers.up import Up, fleet_spec, process_argv, process_environ

from pdfleet.engine.contracts import identity


@pytest.fixture(scope="module")
def up(tiny_model, tmp_path_factory):
    fleet = Up(
        fleet_spec(tiny_model),
        tmp_path_factory.mktemp("security-up"),
        env={"PDFLEET_API_KEY": CLIENT_KEY},
    )
    try:
        yield fleet.wait_ready()
    finally:
        fleet.stop()


def mode(path) -> int:
    return stat.S_IMODE(path.stat().st_mode)


def test_engines_refuse_client_keys_and_run_files_are_the_owners_only(up):
    (run,) = up.run_dir.iterdir()
    assert mode(run) == 0o700
    assert mode(run / "engines.json") == 0o600
    ids = sorted((run / "identity").iterdir())
    assert [p.stem for p in ids] == ["decode-0", "prefill-0"]
    assert all(mode(p) == 0o600 for p in ids)
    for role in ("prefill", "decode"):
        url = up.engine_url(role)
        r = httpx.get(url + "/v1/models", headers={"authorization": f"Bearer {CLIENT_KEY}"})
        assert r.status_code == 401, (role, r.text)
        assert httpx.get(url + "/v1/models", headers=fleet_headers()).status_code == 200
    # The gateway takes the key, and P/D runs between engines with identities.
    body = {"model": "tiny", "prompt": prompt(9701), "max_tokens": 4, "temperature": 0}
    r = httpx.post(
        up.url + "/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {CLIENT_KEY}"},
        timeout=120,
    )
    assert r.status_code == 200, r.text
    decode = up.engine_url("decode")
    assert scrape(decode)["pdfleet_engine_kv_transfers_total"] >= 1


def test_each_engine_has_its_own_identity_and_no_key_on_its_command_line(up):
    subjects = set()
    for pid in up.child_pids():
        env = process_environ(pid)
        if identity.IDENTITY_FILE_ENV not in env:
            continue  # the gateway
        own = identity.EngineIdentity.read(
            env[identity.IDENTITY_FILE_ENV], env[identity.IDENTITY_AUTHORITY_ENV]
        )
        subjects.add(own.claims.subject)
        with open(env[identity.IDENTITY_FILE_ENV]) as f:
            private = json.load(f)["key"]
        assert not any(private in arg for arg in process_argv(pid))
        assert private not in "".join(env.values())
        assert env.get("PDFLEET_API_KEY", "") == ""
    assert subjects == {"tiny/prefill-0", "tiny/decode-0"}
