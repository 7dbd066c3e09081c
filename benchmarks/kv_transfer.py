"""KV-transfer bandwidth and P/D handover latency.

Part 1 (connector bandwidth): two processes, each a real ``PDConnector`` around
a KV buffer shaped like a 1B-class model (16 layers, 8 KV heads, head_dim 64,
bf16: 32 KiB per token). The consumer pulls the blocks of a 1k / 4k / 16k
token prompt through the connector (side channel + per-block descriptors),
then the same number of bytes as one raw NIXL READ of a contiguous region,
and a memcpy of the same bytes in one process. Prints GB/s and the ratio
connector / raw NIXL (target >= 70% from 4k tokens up).

Part 2 (handover): a prefill and a decode `pdfleet serve` on the tiny model
with NixlConnector; for N prompts of ~1k tokens, handover = time from the
prefill response to the decode leg's first streamed token. Prints p50 / p90.

Part 3 (content check): what the decode engine adds per decode leg to check
that the leased blocks are its prompt's (the signed block hash chain against
its own): with the producer's hash algorithm (it reuses the hashes it
computed at admission for its prefix cache) and with another one (it hashes
the prompt again), for 1k / 4k / 16k-token prompts. Microseconds, median.

    .venv/bin/python benchmarks/kv_transfer.py [--connector NixlConnector|ZmqConnector]
        [--json PATH] [--skip-handover]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

from pdfleet.engine.contracts.launch import python_module

LAYOUT = {
    "num_hidden_layers": 16,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "num_attention_heads": 16,
    "hidden_size": 1024,
}
TOKENS = (1024, 4096, 16384)
BLOCK = 16
REPS = 6  # timed pulls per size and method (after one warm-up)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_config(model_dir: str, connector: str, role: str, kv_port: int):
    from pdfleet.engine.config import EngineArgs

    return EngineArgs(
        model=model_dir,
        dtype="bfloat16",
        max_model_len=16384 + 64,
        hf_overrides={**LAYOUT, "max_position_embeddings": 32768},
        kv_transfer_config={"kv_connector": connector, "kv_role": role, "kv_port": kv_port},
    ).create_engine_config("server", device="cpu")


def kv_buffer(config, num_blocks: int):
    import torch

    m = config.model_config
    return torch.zeros(
        (m.num_hidden_layers, 2, num_blocks, BLOCK, m.num_key_value_heads, m.head_dim),
        dtype=torch.bfloat16,
    )


def producer(model_dir, connector, kv_port, num_blocks, ready, stop):

    from pdfleet.engine.kv_transfer.connector import Lease, PDConnector

    config = make_config(model_dir, connector, "kv_producer", kv_port)
    c = PDConnector(config)
    buf = kv_buffer(config, num_blocks)
    buf.uniform_(-1, 1)
    c.register(buf)
    # One lease per pull (each is confirmed, and so ended, by its consumer).
    with c.lock:
        for n in TOKENS:
            for rep in range(REPS + 1):
                lid = f"bench-{n}-{rep}"
                c.held[lid] = Lease(lid, list(range(1, n // BLOCK + 1)), time.monotonic() + 600)
    raw = None
    if connector == "NixlConnector":
        raw = c.transport.local.agent.get_agent_metadata()
    ready.put(
        {
            "instance": c.instance_id,
            "engine": c.engine_id,
            "raw_md": raw,
            "base": buf.data_ptr(),
            "checksum": float(buf[:, :, 1:9].float().sum()),
        }
    )
    stop.wait(600)
    c.shutdown()


def consume(model_dir, connector, kv_port, num_blocks, info, results):
    import queue

    import numpy as np
    import torch

    from pdfleet.engine.kv_transfer.connector import Load, PDConnector

    config = make_config(model_dir, connector, "kv_consumer", free_port())
    c = PDConnector(config)
    buf = kv_buffer(config, num_blocks)
    c.register(buf)
    out = {}
    bytes_per_block = c.layout.block_bytes * 2 * c.layout.num_layers
    raw = None
    if connector == "NixlConnector":
        agent = c.transport.local.agent
        raw = (agent, agent.add_remote_agent(info["raw_md"]))

    def pull_connector(n: int, ids: list[int], rep: int) -> float:
        params = {
            "remote_engine_id": info["engine"],
            "remote_instance_id": info["instance"],
            "remote_host": "127.0.0.1",
            "remote_port": kv_port,
            "remote_request_id": f"bench-{n}",
            "remote_block_ids": ids,
            "pdfleet_lease_id": f"bench-{n}-{rep}",
        }
        start = time.perf_counter()
        c.new_loads.put(Load(f"r{n}-{rep}", params, ids, ids, time.monotonic() + 60))
        _rid, ok, why = c.done.get(timeout=120)
        if not ok:
            raise RuntimeError(f"pull failed: {why}")
        return time.perf_counter() - start

    def pull_raw(nbytes: int) -> float:
        # Raw NIXL: the same bytes as one contiguous READ.
        agent, name = raw
        local = np.array([[buf.data_ptr(), nbytes, 0]], dtype=np.uint64)
        remote = np.array([[info["base"], nbytes, 0]], dtype=np.uint64)
        lh = agent.prep_xfer_dlist("NIXL_INIT_AGENT", local, "DRAM")
        rh = agent.prep_xfer_dlist(name, remote, "DRAM")
        x = agent.make_prepped_xfer("READ", lh, [0], rh, [0])
        start = time.perf_counter()
        state = agent.transfer(x)
        deadline = start + 120
        while state == "PROC" and time.perf_counter() < deadline:
            state = agent.check_xfer_state(x)
        elapsed = time.perf_counter() - start
        agent.release_xfer_handle(x)
        agent.release_dlist_handle(lh)
        agent.release_dlist_handle(rh)
        if state != "DONE":
            raise RuntimeError(f"raw NIXL READ ended in state {state}")
        return elapsed

    checksum = None
    for n in TOKENS:
        ids = list(range(1, n // BLOCK + 1))
        nbytes = len(ids) * bytes_per_block
        # Alternate connector and raw pulls so both see the same machine load;
        # the first of each is a warm-up (the connector's includes the handshake).
        times, raw_times = [], []
        for rep in range(REPS + 1):
            elapsed = pull_connector(n, ids, rep)
            if rep:
                times.append(elapsed)
            if checksum is None:
                checksum = float(buf[:, :, 1:9].float().sum())
            if raw is not None:
                elapsed = pull_raw(nbytes)
                if rep:
                    raw_times.append(elapsed)
        out[n] = {"bytes": nbytes, "connector_s": statistics.median(times)}
        if raw_times:
            out[n]["raw_nixl_s"] = statistics.median(raw_times)
    for n in TOKENS:
        src = torch.empty(out[n]["bytes"], dtype=torch.uint8).random_()
        dst = torch.empty_like(src)
        times = []
        for _ in range(4):
            start = time.perf_counter()
            dst.copy_(src)
            times.append(time.perf_counter() - start)
        out[n]["memcpy_s"] = statistics.median(times[1:])
    c.shutdown()
    results.put({"sizes": out, "checksum_match": abs(checksum - info["checksum"]) < 1e-3})
    del queue


def bandwidth(model_dir: str, connector: str) -> dict:
    ctx = mp.get_context("spawn")
    kv_port = free_port()
    num_blocks = TOKENS[-1] // BLOCK + 2
    ready, results, stop = ctx.Queue(), ctx.Queue(), ctx.Event()
    p = ctx.Process(target=producer, args=(model_dir, connector, kv_port, num_blocks, ready, stop))
    p.start()
    try:
        info = ready.get(timeout=300)
        q = ctx.Process(
            target=consume, args=(model_dir, connector, kv_port, num_blocks, info, results)
        )
        q.start()
        res = results.get(timeout=900)
        q.join(60)
    finally:
        stop.set()
        p.join(60)
        if p.is_alive():
            p.kill()
    return res


def handover(model_dir: str, connector: str, n_prompts: int) -> dict:
    import httpx

    logs = tempfile.mkdtemp(prefix="pdfleet-handover-")
    procs = []

    def serve(role: str) -> str:
        port = free_port()
        cfg = {"kv_connector": connector, "kv_role": role, "kv_port": free_port()}
        log = open(os.path.join(logs, f"{role}.log"), "wb")  # noqa: SIM115
        procs.append(
            subprocess.Popen(
                [
                    *python_module("pdfleet.engine.cli"),
                    "serve",
                    model_dir,
                    "--port",
                    str(port),
                    "--max-model-len",
                    "2048",
                    "--disable-log-stats",
                    "--kv-transfer-config",
                    json.dumps(cfg),
                ],
                stdout=log,
                stderr=subprocess.STDOUT,
                # Two engines share the cores: one torch thread each (see docs/gateway.md).
                env={**os.environ, "OMP_NUM_THREADS": "1"},
            )
        )
        return f"http://127.0.0.1:{port}"

    try:
        p_url, d_url = serve("kv_producer"), serve("kv_consumer")
        deadline = time.monotonic() + 300
        for url in (p_url, d_url):
            while True:
                try:
                    if httpx.get(url + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                if time.monotonic() > deadline:
                    raise TimeoutError("servers did not start")
                time.sleep(0.3)
        handovers, prefills, recomputes = [], [], []
        # One client for the whole run: a new httpx client per request costs tens of
        # milliseconds here (TLS context setup), which would be counted as handover.
        # The engines want the fleet token (what the gateway presents).
        from pdfleet.engine.contracts import security

        secret = security.fleet_secret_from_env()
        assert secret is not None
        token = {"authorization": f"Bearer {security.fleet_token(secret)}"}
        with httpx.Client(timeout=60, headers=token) as client:

            def first_event(url: str, body: dict) -> float:
                start = time.perf_counter()
                with client.stream("POST", url + "/v1/completions", json=body) as r:
                    for line in r.iter_lines():
                        if line.startswith("data: {"):
                            return time.perf_counter() - start
                raise RuntimeError(f"no token from {url}")

            for i in range(n_prompts):
                prompt = [(i * 7919 + j * 31) % 1700 + 20 for j in range(1000)]
                body = {"prompt": prompt, "max_tokens": 4, "temperature": 0, "ignore_eos": True}
                t0 = time.perf_counter()
                pre = client.post(
                    p_url + "/v1/completions",
                    json={
                        **body,
                        "max_tokens": 1,
                        "kv_transfer_params": {"do_remote_decode": True},
                    },
                ).json()
                t1 = time.perf_counter()
                handover = first_event(
                    d_url, {**body, "stream": True, "kv_transfer_params": pre["kv_transfer_params"]}
                )
                # The same work without P/D: the decode engine computes an uncached
                # prompt of the same length itself.
                fresh = [(i * 7919 + j * 37 + 5) % 1700 + 20 for j in range(1000)]
                recompute = first_event(d_url, {**body, "prompt": fresh, "stream": True})
                if i:  # the first includes the handshake
                    prefills.append(t1 - t0)
                    handovers.append(handover)
                    recomputes.append(recompute)
        q = statistics.quantiles(handovers, n=10)
        return {
            "prompts": len(handovers),
            "prompt_tokens": 1000,
            "prefill_leg_p50_s": statistics.median(prefills),
            "handover_p50_s": statistics.median(handovers),
            "handover_p90_s": q[8],
            "decode_only_ttft_p50_s": statistics.median(recomputes),
        }
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(30)
            except subprocess.TimeoutExpired:
                p.kill()


def content_check() -> dict:
    """Microseconds per decode leg of the consumer's content check (median of 50)."""
    from types import SimpleNamespace

    from pdfleet.engine.contracts.block_hash import get_hash_fn, prompt_block_hashes
    from pdfleet.engine.kv_transfer.connector import PDConnectorScheduler

    sched = PDConnectorScheduler(SimpleNamespace(block_size=BLOCK, hash_algo="sha256"))  # type: ignore[arg-type]
    out: dict = {}
    if not hasattr(sched, "content_mismatch"):
        return out  # code from before the content check (a baseline run): nothing to time
    for n in TOKENS:
        tokens = [(i * 7919) % 32000 for i in range(n)]
        hashes = prompt_block_hashes(tokens, BLOCK, get_hash_fn("sha256"))
        leased = (n - 1) // BLOCK
        request = SimpleNamespace(num_tokens=n, block_hashes=hashes, all_token_ids=tokens)
        row = {}
        for algo, chain in (
            ("sha256", hashes[leased - 1].hex()),
            (
                "sha256_cbor",
                prompt_block_hashes(tokens, BLOCK, get_hash_fn("sha256_cbor"))[leased - 1].hex(),
            ),
        ):
            params = {
                "remote_block_ids": list(range(leased)),
                "pdfleet_block_chain": chain,
                "pdfleet_block_hash_algo": algo,
            }
            times = []
            for _ in range(50):
                start = time.perf_counter()
                why = sched.content_mismatch(request, params)
                times.append(time.perf_counter() - start)
            assert why is None, why
            row["same_algo_us" if algo == "sha256" else "other_algo_us"] = 1e6 * statistics.median(
                times
            )
        out[n] = row
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--connector", default="NixlConnector", choices=["NixlConnector", "ZmqConnector"]
    )
    parser.add_argument("--json")
    parser.add_argument("--skip-handover", action="store_true")
    parser.add_argument("--handover-prompts", type=int, default=21)
    args = parser.parse_args()
    from pdfleet.engine.contracts import security
    from pdfleet.engine.tiny.builder import ensure_tiny_model

    # Connectors need the fleet secret; the child processes inherit this one.
    if security.fleet_secret_from_env() is None:
        os.environ["PDFLEET_FLEET_SECRET"] = security.generate_secret()

    model_dir = ensure_tiny_model(os.path.join(tempfile.gettempdir(), "pdfleet-kvbench-tiny"))
    result: dict = {"connector": args.connector, "layout": LAYOUT, "dtype": "bfloat16"}
    bw = bandwidth(model_dir, args.connector)
    result["bandwidth"] = bw
    print(f"connector={args.connector}  layout={LAYOUT}  (32 KiB per token)")
    print(
        f"{'tokens':>7} {'MiB':>8} {'connector GB/s':>15} {'raw NIXL GB/s':>14} "
        f"{'memcpy GB/s':>12} {'conn/raw':>9}"
    )
    for n, r in bw["sizes"].items():
        gbps = r["bytes"] / r["connector_s"] / 1e9
        raw = r["bytes"] / r["raw_nixl_s"] / 1e9 if "raw_nixl_s" in r else float("nan")
        mem = r["bytes"] / r["memcpy_s"] / 1e9
        r.update(connector_gbps=gbps, raw_nixl_gbps=raw, memcpy_gbps=mem, ratio=gbps / raw)
        print(
            f"{n:>7} {r['bytes'] / 2**20:>8.0f} {gbps:>15.2f} {raw:>14.2f} {mem:>12.2f} "
            f"{gbps / raw:>9.0%}"
        )
    print(f"data check after pulls: {'ok' if bw['checksum_match'] else 'MISMATCH'}")
    check = content_check()
    result["content_check"] = check
    for n, row in check.items():
        print(
            f"content check, {n}-token prompt: {row['same_algo_us']:.1f} us with the producer's "
            f"hash algorithm, {row['other_algo_us']:.0f} us with another (rehashing the prompt)"
        )
    if not args.skip_handover:
        h = handover(model_dir, args.connector, args.handover_prompts)
        result["handover"] = h
        print(
            f"handover (tiny model, {h['prompt_tokens']}-token prompts, {h['prompts']} runs): "
            f"p50 {1000 * h['handover_p50_s']:.1f} ms, p90 {1000 * h['handover_p90_s']:.1f} ms "
            f"(prefill leg p50 {1000 * h['prefill_leg_p50_s']:.1f} ms; decode-only TTFT of "
            f"the same length p50 {1000 * h['decode_only_ttft_p50_s']:.1f} ms)"
        )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0 if bw["checksum_match"] else 1


if __name__ == "__main__":
    sys.exit(main())
