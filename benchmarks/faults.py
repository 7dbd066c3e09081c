"""Fault benchmark: a `pdfleet up` fleet under steady load while its engines fail.

`pdfleet up` runs 2 prefill + 2 decode engines (the built-in tiny model, or
``--model``) joined by NIXL behind its gateway (``Always`` disaggregation, a
5 s lease), and ``--concurrency`` clients send temperature-0 requests in a
loop (half streamed, prompts from a fixed set, most long enough for a real
KV hand-off). Half the requests are greedy, half seeded sampling
(``temperature`` 0.8, ``top_p`` 0.95, a seed per prompt, ``--seeded-n`` 2
choices each, compared choice by choice), each streamed or
not, ``--max-tokens`` long. Every answer is compared with the same request's
answer from a clean run before the faults. Then, one after the other:

1. ``kill_prefill``: SIGKILL a prefill engine; `pdfleet up` restarts it.
2. ``kill_decode``: SIGKILL a decode engine while it streams; its requests
   migrate to the other decode engine (docs/migration.md).
3. ``sigstop``: SIGSTOP the other decode engine for 10 s, then SIGCONT; the
   stall watchdog ejects it and its streams migrate.
4. ``sigterm_decode``: SIGTERM a decode engine while it streams: it hands
   its streams back (drain by migration); `pdfleet up` restarts it.
5. ``restart_producer_mid_transfer``: SIGKILL a prefill engine while it holds
   leases of finished prefills whose decode legs are pulling.
6. ``lease_expiry``: the two legs by hand, the decode leg delayed past the
   lease: the answer must still be right (recomputed) or a 400 naming
   ``kv_transfer_params``, never someone else's KV.
7. ``rolling_upgrade``: ``pdfleet apply`` of the file with another
   ``maxModelLen`` (same compatibility hash): every engine replaced, decode
   first, one at a time; the old decode engines drain by migration.
8. ``rolling_upgrade_compat``: ``pdfleet apply`` of a new ``model.revision``
   (a new compatibility hash): every engine replaced again; the last
   old-hash decode engine drains once idle (docs/local.md).
9. ``scale_down``: ``--long-streams`` streams of ``--long-tokens`` tokens on
   the fleet; the time a drain that waits for them would take (until they
   end: what a decode scale-down took before migration) against the time a
   decode engine that has them takes to exit on SIGTERM (after), the streams
   compared with the unfaulted ones.

Per phase: requests sent, failed, wrong, the longest request (stall), the
slowest error event after a kill, the engine's restart time and the time
the gateway took to route to it again after it came back; the migrations
the gateway counted and their resume latency (p50/p99 of the gateway's
``resumed ... in Xs`` log lines). Targets: 0 failed, 0 wrong in every
phase; resume p99 < 2 s; routing recovered within 10 s. Rerun:

    .venv/bin/python benchmarks/faults.py --json benchmarks/results/faults_cpu.json

``--upgrade-only``: the clean run, ``steady`` and the two rolling upgrades.
``--scale-down-only``: ``scale_down`` alone.

A wrong answer is described (``wrong_detail``, ``long_wrong_detail``): per
choice that differs, where (character; token, for the long streams, which
ask ``logprobs`` 0), and the gateway's log lines of the request's moves (its
``x-request-id``: the engine, the resume latency, the tokens replayed).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import yaml
from fleet import free_port, tiny_model

from pdfleet.engine.contracts.launch import python_module
from pdfleet.engine.contracts.metrics import ENGINE_KV_TRANSFER_HELD_REQUESTS, parse_metrics
from pdfleet.engine.contracts.security import fleet_token, generate_secret

LEASE_SECONDS = 5
STORY = (
    "The harbor was quiet before dawn, and the fishing boats rocked gently against the old "
    "wooden pier while gulls circled overhead waiting for the first catch of the day. "
)


CHOICES_SEP = "\x1e"
"""Between the texts of a request's choices (by index) in ``Result.text`` (a
generated text may hold it too: ``Result.choices`` has them apart)."""


@dataclass
class Result:
    prompt: int
    stream: bool
    seeded: bool
    start: float
    end: float = 0.0
    ok: bool = False
    text: str = ""
    error: str = ""
    error_at: float = 0.0
    choices: tuple[str, ...] = ()
    """Each choice's text, by index."""
    request_id: str = ""
    """Sent as ``x-request-id``: the gateway's log names the request's moves by it."""
    tokens: dict[int, list[str]] | None = None
    """Per choice, its tokens (asked with ``logprobs``: the long streams)."""


class Bench:
    def __init__(self, args: argparse.Namespace, tmp: Path) -> None:
        self.args = args
        self.tmp = tmp
        self.secret = generate_secret()
        self.headers = {"authorization": f"Bearer {fleet_token(self.secret.encode())}"}
        self.prompts = [f"Story {i}: " + STORY * (3 if i % 4 else 1) for i in range(16)]
        self.reference: dict[tuple[int, bool], str] = {}
        self.reference_choices: dict[tuple[int, bool], tuple[str, ...]] = {}
        self.results: list[Result] = []
        self.stop_load = False
        self.num_sent = 0

    # -- the fleet ------------------------------------------------------------------

    def start(self) -> None:
        spec = {
            "apiVersion": "pdfleet.dev/v1alpha1",
            "kind": "InferenceService",
            "metadata": {"name": "faults"},
            "spec": {
                "engine": {"maxModelLen": 1024, "maxNumSeqs": 32, "disableLogStats": True},
                "kvTransfer": {"connector": "NixlConnector", "leaseSeconds": LEASE_SECONDS},
                "prefill": {"replicas": 2},
                "decode": {"replicas": 2},
                "disaggregation": {"mode": "Always"},
            },
        }
        if self.args.model:
            spec["spec"]["model"] = {"name": "tiny", "uri": f"file://{self.args.model}"}
        else:
            spec["spec"]["model"] = {"name": "tiny", "uri": f"file://{tiny_model()}"}
        path = self.tmp / "faults.yaml"
        path.write_text(yaml.safe_dump(spec))
        self.spec = spec
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.run_dir = self.tmp / "run"
        self.out_path = self.tmp / "up.out"
        self.out = open(self.out_path, "wb")  # noqa: SIM115 (closed in close())
        env = {**os.environ, "PDFLEET_FLEET_SECRET": self.secret, "OMP_NUM_THREADS": "1"}
        env.pop("PDFLEET_API_KEY", None)
        self.up = subprocess.Popen(
            [
                *(*python_module("pdfleet.engine.cli"), "up", str(path)),
                *("--port", str(self.port), "--run-dir", str(self.run_dir), "--timeout", "300"),
            ],
            stdout=self.out,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        deadline = time.monotonic() + 400
        while "ready: " not in self.out_path.read_text(errors="replace"):
            if self.up.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"pdfleet up failed:\n{self.out_path.read_text()[-3000:]}")
            time.sleep(0.5)
        self.wait_routable(4, 60)

    def close(self) -> None:
        if self.up.poll() is None:
            try:
                for pid in self.engine_pids().values():  # a stopped engine cannot exit
                    os.kill(pid, signal.SIGCONT)
            except (OSError, ValueError):
                pass
            self.up.send_signal(signal.SIGINT)
            try:
                self.up.wait(120)
            except subprocess.TimeoutExpired:
                os.killpg(self.up.pid, signal.SIGKILL)
                self.up.wait(10)
        self.out.close()

    def engines(self) -> dict[str, list[str]]:
        (engines_file,) = self.run_dir.glob("*/engines.json")
        out: dict[str, list[str]] = {"prefill": [], "decode": []}
        for e in json.loads(engines_file.read_text())["engines"]:
            out[e["role"]].append(e["url"])
        return {role: sorted(urls) for role, urls in out.items()}

    def engine_pids(self) -> dict[str, int]:
        pids = {}
        for urls in self.engines().values():
            for url in urls:
                pid = listener_pid(int(url.rsplit(":", 1)[1]))
                if pid:
                    pids[url] = pid
        return pids

    def view(self) -> dict:
        return httpx.get(self.url + "/engines", headers=self.headers, timeout=5).json()

    def routable(self, url: str) -> bool:
        try:
            return any(e["url"] == url and e["state"] == "healthy" for e in self.view()["engines"])
        except httpx.HTTPError:
            return False

    def wait_routable(self, n: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with_state = self.view()["routable"]
            if with_state["prefill"] + with_state["decode"] >= n:
                return
            time.sleep(0.2)
        raise TimeoutError(f"fewer than {n} engines routable after {timeout}s: {self.view()}")

    # -- load -----------------------------------------------------------------------

    def body(
        self, i: int, seeded: bool, max_tokens: int | None = None, logprobs: int | None = None
    ) -> dict:
        body = {
            "model": "tiny",
            "prompt": self.prompts[i],
            "max_tokens": max_tokens or self.args.max_tokens,
            "temperature": 0,
            "ignore_eos": True,
        }
        if logprobs is not None:
            body["logprobs"] = logprobs
        if seeded:
            # Several choices per seeded request: each moves on its own.
            body |= {"temperature": 0.8, "top_p": 0.95, "seed": 1000 + i, "n": self.args.seeded_n}
        return body

    async def one(
        self, client: httpx.AsyncClient, i: int, stream: bool, seeded: bool = False, **kw
    ) -> Result:
        self.num_sent += 1
        r = Result(i, stream, seeded, time.monotonic(), request_id=f"faults-{self.num_sent}")
        body = self.body(i, seeded, **kw)
        headers = {"x-request-id": r.request_id}
        tokens: dict[int, list[str]] = {}
        try:
            if stream:
                async with client.stream(
                    "POST", "/v1/completions", json={**body, "stream": True}, headers=headers
                ) as resp:
                    if resp.status_code != 200:
                        r.error = f"HTTP {resp.status_code}"
                    texts: dict[int, str] = {}
                    async for line in resp.aiter_lines():
                        if not line.startswith("data: {"):
                            continue
                        event = json.loads(line[6:])
                        if "error" in event:
                            r.error, r.error_at = event["error"]["message"], time.monotonic()
                            break
                        for c in event.get("choices", []):
                            texts[c["index"]] = texts.get(c["index"], "") + c.get("text", "")
                            if c.get("logprobs"):
                                tokens.setdefault(c["index"], []).extend(c["logprobs"]["tokens"])
                    r.choices = tuple(texts[k] for k in sorted(texts))
            else:
                resp = await client.post("/v1/completions", json=body, headers=headers)
                if resp.status_code == 200:
                    choices = sorted(resp.json()["choices"], key=lambda c: c["index"])
                    r.choices = tuple(c["text"] for c in choices)
                    for c in choices:
                        if c.get("logprobs"):
                            tokens[c["index"]] = list(c["logprobs"]["tokens"])
                else:
                    r.error, r.error_at = (
                        f"HTTP {resp.status_code}: {resp.text[:200]}",
                        time.monotonic(),
                    )
        except httpx.HTTPError as e:
            r.error, r.error_at = f"{type(e).__name__}: {e}", time.monotonic()
        r.text = CHOICES_SEP.join(r.choices)
        r.ok = not r.error
        r.end = time.monotonic()
        r.tokens = tokens or None
        return r

    async def load(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:

            async def worker(w: int) -> None:
                k = w
                while not self.stop_load:
                    k += self.args.concurrency
                    self.results.append(
                        await self.one(client, k % len(self.prompts), k % 2 == 0, k % 4 >= 2)
                    )

            await asyncio.gather(*(worker(w) for w in range(self.args.concurrency)))

    async def clean_run(self) -> None:
        async with httpx.AsyncClient(base_url=self.url, timeout=120) as client:
            for i in range(len(self.prompts)):
                for seeded in (False, True):
                    r = await self.one(client, i, False, seeded)
                    if not r.ok:
                        raise RuntimeError(f"clean run failed: {r.error}")
                    self.reference[i, seeded] = r.text
                    self.reference_choices[i, seeded] = r.choices

    # -- faults ---------------------------------------------------------------------

    async def wait_return(self, url: str, timeout: float = 120) -> tuple[float, float]:
        """Seconds until the engine answers /health again, then until the gateway routes it."""
        start = time.monotonic()
        deadline = start + timeout
        async with httpx.AsyncClient(timeout=1) as client:
            while time.monotonic() < deadline:
                try:
                    if (await client.get(url + "/health")).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                await asyncio.sleep(0.1)
        back = time.monotonic()
        while time.monotonic() < deadline and not await asyncio.to_thread(self.routable, url):
            await asyncio.sleep(0.1)
        return back - start, time.monotonic() - back

    async def phase(self, name: str, fault) -> dict:
        first = len(self.results)
        resumed = len(self.resume_latencies())
        moved = self.migrations()
        started = time.monotonic()
        extra = await fault()
        await asyncio.sleep(self.args.settle)
        took = time.monotonic() - started
        latencies = self.resume_latencies()[resumed:]
        out = (
            self.summarize(self.results[first:])
            | {
                "phase_s": round(took, 1),
                "migrations": {
                    k: v - moved.get(k, 0)
                    for k, v in self.migrations().items()
                    if v > moved.get(k, 0)
                },
            }
            | ({"resume_s": percentiles(latencies)} if latencies else {})
            | extra
        )
        print(f"{name}: {out}", flush=True)
        return out

    def migrations(self) -> dict[str, float]:
        """The gateway's pdfleet_gateway_migrations_total by reason."""
        text = httpx.get(self.url + "/metrics", headers=self.headers, timeout=5).text
        found = re.findall(
            r'^pdfleet_gateway_migrations_total\{reason="(\w+)"\} ([0-9.e+]+)$', text, re.M
        )
        return {reason: float(v) for reason, v in found}

    def resume_latencies(self) -> list[float]:
        """Seconds from a decode leg's failure to its resumed leg's first event,
        from the gateway's log, in order."""
        (log,) = self.run_dir.glob("*/gateway.log")
        text = log.read_text(errors="replace")
        return [float(x) for x in re.findall(r"resumed on \S+ in ([0-9.]+)s", text)]

    def moves_of(self, request_id: str) -> list[str]:
        """The gateway's log lines of a request's moves (the engine it resumed on,
        how long it took, the tokens replayed: the resume point of a request of
        one choice; of several choices, their sum)."""
        (log,) = self.run_dir.glob("*/gateway.log")
        text = log.read_text(errors="replace")
        return re.findall(rf"request {re.escape(request_id)}: (.*)", text)

    def divergence(self, r: Result, want: tuple[str, ...], ref_tokens: dict | None = None) -> dict:
        """Where a wrong answer left the unfaulted one: per choice that differs,
        the character offset and (with tokens) the token position of the first
        difference, the text around it, and the request's moves."""
        choices = []
        got = r.choices
        for c in range(max(len(got), len(want))):
            a = got[c] if c < len(got) else ""
            b = want[c] if c < len(want) else ""
            if a == b:
                continue
            at = next((k for k in range(min(len(a), len(b))) if a[k] != b[k]), min(len(a), len(b)))
            d: dict = {"choice": c, "char": at, "got": a[at : at + 24], "want": b[at : at + 24]}
            if r.tokens is not None and ref_tokens is not None:
                ta, tb = r.tokens.get(c, []), ref_tokens.get(c, [])
                d["token"] = next(
                    (k for k in range(min(len(ta), len(tb))) if ta[k] != tb[k]),
                    min(len(ta), len(tb)),
                )
                d["tokens"] = [len(ta), len(tb)]
            choices.append(d)
        return {
            "prompt": r.prompt,
            "seeded": r.seeded,
            "stream": r.stream,
            "request_id": r.request_id,
            "choices": choices,
            "moves": self.moves_of(r.request_id),
        }

    def summarize(self, results: list[Result]) -> dict:
        wrong = [r for r in results if r.ok and r.text != self.reference[r.prompt, r.seeded]]
        failed = [r for r in results if not r.ok]
        return {
            "sent": len(results),
            "failed": len(failed),
            "wrong": len(wrong),
            "wrong_detail": [
                self.divergence(r, self.reference_choices[r.prompt, r.seeded]) for r in wrong[:10]
            ],
            "longest_request_s": round(max((r.end - r.start for r in results), default=0), 2),
            "errors": sorted({r.error[:120] for r in failed}),
        }

    async def kill(self, role: str, index: int) -> dict:
        url = self.engines()[role][index]

        def inflight() -> int:
            return next(e["inflight"] for e in self.view()["engines"] if e["url"] == url)

        deadline = time.monotonic() + 10
        while await asyncio.to_thread(inflight) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # kill it while it works
        busy = await asyncio.to_thread(inflight)
        os.kill(self.engine_pids()[url], signal.SIGKILL)
        killed = time.monotonic()
        await asyncio.sleep(0.5)
        restart_s, recovery_s = await self.wait_return(url)
        late = [r.error_at - killed for r in self.results if not r.ok and r.error_at >= killed]
        return {
            "engine": url,
            "inflight_at_kill": busy,
            "slowest_error_event_s": round(max(late, default=0), 2),
            "restart_s": round(restart_s, 1),
            "routing_recovered_s": round(recovery_s, 1),
        }

    async def sigterm(self, role: str, index: int) -> dict:
        url = self.engines()[role][index]

        def inflight() -> int:
            return next(e["inflight"] for e in self.view()["engines"] if e["url"] == url)

        deadline = time.monotonic() + 10
        while await asyncio.to_thread(inflight) == 0 and time.monotonic() < deadline:
            await asyncio.sleep(0.01)  # while it works
        busy = await asyncio.to_thread(inflight)
        pid = self.engine_pids()[url]
        os.kill(pid, signal.SIGTERM)
        signalled = time.monotonic()
        while time.monotonic() < signalled + 60 and pid_alive(pid):
            await asyncio.sleep(0.02)
        exited_s = time.monotonic() - signalled
        restart_s, recovery_s = await self.wait_return(url)
        return {
            "engine": url,
            "inflight_at_sigterm": busy,
            "exited_s": round(exited_s, 2),
            "restart_s": round(restart_s, 1),
            "routing_recovered_s": round(recovery_s, 1),
        }

    async def scale_down(self) -> dict:
        """Long streams: how long a drain that waits for them takes (before),
        and how long a decode engine holding them takes to leave on SIGTERM."""
        n, tokens = self.args.long_streams, self.args.long_tokens
        async with httpx.AsyncClient(base_url=self.url, timeout=600) as client:

            async def streams() -> list[Result]:
                # logprobs=0: each choice's tokens, to place a divergence exactly.
                return await asyncio.gather(
                    *(
                        self.one(client, i, True, i % 2 == 1, max_tokens=tokens, logprobs=0)
                        for i in range(n)
                    )
                )

            def decode_view() -> list[dict]:
                return [e for e in self.view()["engines"] if e["role"] == "decode"]

            async def all_running() -> float:
                deadline = time.monotonic() + 30
                while time.monotonic() < deadline:
                    view = await asyncio.to_thread(decode_view)
                    if sum(e["inflight"] for e in view) >= n:
                        break
                    await asyncio.sleep(0.05)
                await asyncio.sleep(1.0)  # well into the streams
                return time.monotonic()

            # Before: a drain waits until the streams end.
            task = asyncio.create_task(streams())
            t0 = await all_running()
            reference = await task
            waited_s = max(r.end for r in reference) - t0
            # After: SIGTERM the decode engine holding the most of them, --rounds times.
            exits: list[float] = []
            on_engine: list[int] = []
            failed = wrong = 0
            wrong_detail: list[dict] = []
            resumed = len(self.resume_latencies())
            for _ in range(self.args.rounds):
                task = asyncio.create_task(streams())
                await all_running()
                view = await asyncio.to_thread(decode_view)
                busiest = max(view, key=lambda e: e["inflight"])
                pid = self.engine_pids()[busiest["url"]]
                os.kill(pid, signal.SIGTERM)
                signalled = time.monotonic()
                while time.monotonic() < signalled + 120 and pid_alive(pid):
                    await asyncio.sleep(0.02)
                exits.append(round(time.monotonic() - signalled, 2))
                on_engine.append(busiest["inflight"])
                moved = await task
                failed += sum(not r.ok for r in moved)
                for r, ref in zip(moved, reference, strict=True):
                    if r.ok and r.text != ref.text:
                        wrong += 1
                        wrong_detail.append(self.divergence(r, ref.choices, ref.tokens))
                await self.wait_return(busiest["url"])
        latencies = self.resume_latencies()[resumed:]
        return {
            "long_streams": n,
            "long_tokens": tokens,
            "streams_on_drained_engine": on_engine,
            "before_wait_for_streams_s": round(waited_s, 2),
            "after_sigterm_to_exit_s": exits,
            "long_failed": failed,
            "long_wrong": wrong,
            # Wrong streams that never moved (not on the drained engine):
            # their unfaulted run and this one differ by the batch's numerics
            # alone (docs/migration.md, "Exactness and float ties").
            "long_wrong_unmoved": sum(not d["moves"] for d in wrong_detail),
            "long_wrong_detail": wrong_detail,
            "resume_s": percentiles(latencies) if latencies else None,
        }

    async def sigstop(self) -> dict:
        url = self.engines()["decode"][1]
        pid = self.engine_pids()[url]
        os.kill(pid, signal.SIGSTOP)
        try:
            await asyncio.sleep(10)
        finally:
            os.kill(pid, signal.SIGCONT)
        _, recovery_s = await self.wait_return(url)
        return {"engine": url, "stopped_s": 10, "routing_recovered_s": round(recovery_s, 1)}

    async def restart_producer_mid_transfer(self) -> dict:
        url = self.engines()["prefill"][1]
        held_metric = ENGINE_KV_TRANSFER_HELD_REQUESTS.name
        deadline = time.monotonic() + 30
        held = 0.0
        async with httpx.AsyncClient(timeout=2, headers=self.headers) as client:
            while time.monotonic() < deadline:  # leases held: decode legs are pulling
                text = (await client.get(url + "/metrics")).text
                held = parse_metrics(text, only=[held_metric]).total(held_metric) or 0.0
                if held > 0:
                    break
                await asyncio.sleep(0.02)
        os.kill(self.engine_pids()[url], signal.SIGKILL)
        restart_s, recovery_s = await self.wait_return(url)
        return {
            "engine": url,
            "held_leases_at_kill": held,
            "restart_s": round(restart_s, 1),
            "routing_recovered_s": round(recovery_s, 1),
        }

    async def lease_expiry(self) -> dict:
        engines = self.engines()
        outcomes = []
        async with httpx.AsyncClient(timeout=60, headers=self.headers) as client:
            for i in (1, 2, 3):
                body = self.body(i, False)
                pre = await client.post(
                    engines["prefill"][0] + "/v1/completions",
                    json={
                        **body,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True},
                    },
                )
                params = pre.json().get("kv_transfer_params")
                await asyncio.sleep(LEASE_SECONDS + 1.5)  # the decode leg is late
                dec = await client.post(
                    engines["decode"][0] + "/v1/completions",
                    json={**body, "kv_transfer_params": params},
                )
                if dec.status_code == 200:
                    right = dec.json()["choices"][0]["text"] == self.reference[i, False]
                    outcomes.append("right" if right else "WRONG")
                elif dec.status_code == 400 and "kv_transfer_params" in dec.text:
                    outcomes.append("refused_expired")
                else:
                    outcomes.append(f"HTTP {dec.status_code}")
        return {"delayed_decode_legs": outcomes, "wrong_delayed": outcomes.count("WRONG")}

    async def upgrade(self, change: dict) -> dict:
        """``pdfleet apply`` of the fleet's file with ``change`` merged into its
        spec (one level deep), under the running load."""
        spec = json.loads(json.dumps(self.spec))
        for key, value in change.items():
            spec["spec"][key] = {**spec["spec"].get(key, {}), **value}
        self.spec = spec
        path = self.tmp / f"upgrade-{time.monotonic_ns()}.yaml"
        path.write_text(yaml.safe_dump(spec))
        before = set(self.engine_pids().values())
        started = time.monotonic()
        done = await asyncio.to_thread(
            subprocess.run,
            [
                *python_module("pdfleet.engine.cli"),
                "apply",
                str(path),
                "--run-dir",
                str(self.run_dir),
            ],
            capture_output=True,
            text=True,
            timeout=900,
            env={**os.environ, "PDFLEET_FLEET_SECRET": self.secret},
        )
        took = time.monotonic() - started
        after = set(self.engine_pids().values())
        return {
            "apply_rc": done.returncode,
            "apply_s": round(took, 1),
            "engines_replaced": len(before - after),
            "engines_now": len(after),
            "drains": re.findall(r"draining \S+ \(([^)]+)\)", done.stdout),
            **({"apply_error": (done.stdout + done.stderr)[-500:]} if done.returncode else {}),
        }

    async def run(self) -> dict:
        if self.args.scale_down_only:
            report = {"scale_down": await self.scale_down()}
            report["total"] = report["scale_down"]
            return report
        await self.clean_run()
        load = asyncio.create_task(self.load())
        report: dict = {}
        if self.args.upgrade_only:
            try:
                report["steady"] = await self.phase("steady", self._nothing)
                await self.upgrade_phases(report)
            finally:
                self.stop_load = True
                await asyncio.wait_for(load, 180)
            report["total"] = self.summarize(self.results)
            return report
        try:
            report["steady"] = await self.phase("steady", self._nothing)
            report["kill_prefill"] = await self.phase(
                "kill_prefill", lambda: self.kill("prefill", 0)
            )
            report["kill_decode"] = await self.phase("kill_decode", lambda: self.kill("decode", 0))
            report["sigstop"] = await self.phase("sigstop", self.sigstop)
            report["sigterm_decode"] = await self.phase(
                "sigterm_decode", lambda: self.sigterm("decode", 0)
            )
            report["restart_producer_mid_transfer"] = await self.phase(
                "restart_producer_mid_transfer", self.restart_producer_mid_transfer
            )
            report["lease_expiry"] = await self.phase("lease_expiry", self.lease_expiry)
            await self.upgrade_phases(report)
        finally:
            self.stop_load = True
            await asyncio.wait_for(load, 180)
        report["total"] = self.summarize(self.results)
        all_resumes = self.resume_latencies()
        if all_resumes:
            report["total"]["resume_s"] = percentiles(all_resumes)
        report["scale_down"] = await self.scale_down()
        print(f"scale_down: {report['scale_down']}", flush=True)
        return report

    async def upgrade_phases(self, report: dict) -> None:
        report["rolling_upgrade"] = await self.phase(
            "rolling_upgrade", lambda: self.upgrade({"engine": {"maxModelLen": 1280}})
        )
        report["rolling_upgrade_compat"] = await self.phase(
            "rolling_upgrade_compat", lambda: self.upgrade({"model": {"revision": "v2"}})
        )

    async def _nothing(self) -> dict:
        await asyncio.sleep(self.args.settle)
        return {}


def percentiles(values: list[float]) -> dict:
    ordered = sorted(values)

    def at(q: float) -> float:
        return round(ordered[min(len(ordered) - 1, int(q * len(ordered)))], 3)

    return {"n": len(ordered), "p50": at(0.5), "p99": at(0.99), "max": round(ordered[-1], 3)}


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by pdfleet up) has left.
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def listener_pid(port: int) -> int | None:
    """The pid of the process listening on 127.0.0.1:``port`` (from ``ss``)."""
    out = subprocess.run(
        ["ss", "-ltnpH", f"sport = :{port}"], capture_output=True, text=True, timeout=10
    ).stdout
    m = re.search(r"pid=(\d+)", out)
    return int(m.group(1)) if m else None


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", help="model directory (default: the built-in tiny model)")
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--settle", type=float, default=5, help="seconds of load after a fault")
    parser.add_argument("--max-tokens", type=int, default=160, help="tokens per load request")
    parser.add_argument(
        "--seeded-n", type=int, default=2, help="choices (n) of each seeded load request"
    )
    parser.add_argument("--long-streams", type=int, default=4, help="streams of scale_down")
    parser.add_argument("--long-tokens", type=int, default=700, help="tokens per long stream")
    parser.add_argument("--rounds", type=int, default=3, help="SIGTERMs of scale_down")
    parser.add_argument("--json", help="write the numbers to this file")
    parser.add_argument(
        "--scale-down-only",
        action="store_true",
        help="only scale_down (its streams are compared with its own unfaulted run)",
    )
    parser.add_argument(
        "--upgrade-only",
        action="store_true",
        help="only the clean run, steady and the rolling upgrades (pdfleet apply)",
    )
    args = parser.parse_args()
    bench = Bench(args, Path(tempfile.mkdtemp(prefix="pdfleet-faults-")))
    started = time.monotonic()
    try:
        bench.start()
        report = asyncio.run(bench.run())
    finally:
        bench.close()
    report["config"] = vars(args) | {"lease_seconds": LEASE_SECONDS, "logs": str(bench.tmp)}
    report["wall_s"] = round(time.monotonic() - started, 1)
    print(json.dumps(report["total"], indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
