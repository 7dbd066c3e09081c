"""The gateway's CPU instructions per completion request, counted by callgrind.

CPU time per request (``gateway_throughput.py``) moves by 10-20% with what
else runs on a shared machine; the instructions a request costs do not (two
runs of one tree agree within 0.5%). This counts them: the stub engine of
``gateway_throughput.py`` (nginx, ``--engine-comments`` by default: pdfleet's
``: ids N`` comments, which the gateway reads and strips), one gateway at a
time under ``valgrind --tool=callgrind``, warmed up with instrumentation off,
then ``--requests`` streamed completions (``--non-streamed``: JSON ones, from
the stub's JSON engine) over ``--connections`` kept-alive connections with it
on; each answer is checked against what the client should get. The callgrind
files stay in the run's directory (printed) for ``callgrind_annotate``. User-space instructions only: the system calls' kernel time is
not in the count.

    .venv/bin/python benchmarks/gateway_instructions.py [--requests 300]
        [--connections 16] [--plain] [--non-streamed] [--rounds 2] [TREE ...]

A TREE is a directory holding a ``pdfleet/`` copy of another commit's
packages (``git archive REV engine kernels operator | tar -x -C TREE/pdfleet``),
put first on the gateway's PYTHONPATH; ``.`` is this checkout. Needs
valgrind, nginx and taskset; the scrape interval is 30 s, so that background
work weighs little on the count.
"""

from __future__ import annotations

import argparse
import asyncio
import glob
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import gateway_throughput as gt
import httpx
from fleet import free_port


async def _client(
    url: str, requests: int, connections: int, want: bytes, stream: bool = True
) -> int:
    """Send ``requests`` completions (streamed or not), read each whole; how
    many differ from ``want``."""
    host, port = url.split("//")[1].split(":")
    body = json.dumps({"model": "stub", "prompt": gt.PROMPT, "max_tokens": 25, "stream": stream})
    head = (
        f"POST /v1/completions HTTP/1.1\r\nHost: {host}:{port}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n{body}"
    ).encode()
    bad = 0

    async def worker(count: int) -> None:
        nonlocal bad
        reader, writer = await asyncio.open_connection(host, int(port))
        for _ in range(count):
            writer.write(head)
            await writer.drain()
            ok = b" 200 " in await reader.readline()
            length = None
            while (line := await reader.readline()) != b"\r\n":
                name, _, value = line.partition(b":")
                if name.strip().lower() == b"content-length":
                    length = int(value)
            if length is not None:
                got = await reader.readexactly(length)
            else:  # chunked
                got = b""
                while size := int((await reader.readline()).strip(), 16):
                    got += (await reader.readexactly(size + 2))[:-2]
                await reader.readexactly(2)
            bad += not ok or got != want
        writer.close()

    share = [requests // connections + (i < requests % connections) for i in range(connections)]
    await asyncio.gather(*(worker(n) for n in share if n))
    return bad


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("trees", nargs="*", default=["."])
    ap.add_argument("--requests", type=int, default=300)
    ap.add_argument("--connections", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--plain", action="store_true", help="the stub streams no migration comments")
    ap.add_argument(
        "--non-streamed", action="store_true", help="JSON completions instead of streamed ones"
    )
    args = ap.parse_args()
    stream = not args.non_streamed
    streamed = gt.stream(comments=not args.plain)
    gt.STREAM_BODY[0] = streamed
    # What the client gets: the events without the migration comments, or the
    # engine's JSON answer as it is.
    want = (
        re.sub(r"(?m)^: (ids|end) [^\n]*\n", "", streamed) if stream else gt.COMPLETION
    ).encode()

    run_dir = Path(tempfile.mkdtemp(prefix="gw-instructions-"))
    (run_dir / "nginx").mkdir()
    sse, js = free_port(), free_port()
    conf = run_dir / "nginx.conf"
    conf.write_text(gt.nginx_conf(run_dir, [js], [sse]))
    procs = gt.Procs(run_dir)
    procs.start("nginx", ["nginx", "-c", str(conf), "-p", str(run_dir / "nginx")], "1")
    body = {"model": "stub", "prompt": gt.PROMPT, "max_tokens": 25, "stream": stream}
    engine = sse if stream else js
    counts: dict[str, list[float]] = {}
    try:
        for r in range(args.rounds):
            for i, tree in enumerate(args.trees):
                port = free_port()
                env = {"PDFLEET_API_KEY": "", "PDFLEET_API_KEY_FILE": ""}
                if tree != ".":
                    env["PYTHONPATH"] = str(Path(tree).resolve())
                out = run_dir / f"callgrind-{r}-{i}.out"
                cmd = [
                    "valgrind", "--tool=callgrind", "--instr-atstart=no",
                    f"--callgrind-out-file={out}",
                    *gt.python_module("pdfleet.engine.cli"), "gateway",
                    "--host", "127.0.0.1", "--port", str(port),
                    "--decode", f"http://127.0.0.1:{engine}", "--disaggregation-mode", "Disabled",
                    "--scrape-interval", "30",
                ]  # fmt: skip
                proc = procs.start(f"gateway-{r}-{i}", cmd, "0", env)
                url = f"http://127.0.0.1:{port}"
                deadline = time.monotonic() + 600
                while True:  # until it serves (valgrind starts it slowly)
                    try:
                        if httpx.post(url + "/v1/completions", json=body, timeout=30).is_success:
                            break
                    except httpx.HTTPError:
                        pass
                    if time.monotonic() > deadline or proc.poll() is not None:
                        raise SystemExit(f"{url} did not serve; see {run_dir}")
                    time.sleep(1)
                asyncio.run(_client(url, 50, args.connections, want, stream))  # warm, not counted
                control = ["callgrind_control", str(proc.pid)]
                subprocess.run(
                    [*control[:1], "-i", "on", *control[1:]], check=True, capture_output=True
                )
                bad = asyncio.run(_client(url, args.requests, args.connections, want, stream))
                subprocess.run(
                    [*control[:1], "-i", "off", *control[1:]], check=True, capture_output=True
                )
                subprocess.run([*control[:1], "-d", *control[1:]], check=True, capture_output=True)
                procs.stop(proc)
                total = 0
                for dump in glob.glob(f"{out}*"):
                    for line in Path(dump).read_text().splitlines():
                        if line.startswith(("totals:", "summary:")):
                            total = max(total, int(line.split()[1]))
                per = total / args.requests
                counts.setdefault(tree, []).append(per)
                print(
                    f"round {r} {tree}: {per / 1e3:.1f} k instructions a request "
                    f"({args.requests} requests, {bad} wrong answers, "
                    f"load {os.getloadavg()[0]:.1f})",
                    flush=True,
                )
    finally:
        procs.close()
    for tree, values in counts.items():
        print(f"{tree}: {[round(v / 1e3, 1) for v in values]} k instructions a request")
    print(f"callgrind files: {run_dir}/callgrind-*.out")
    return 0


if __name__ == "__main__":
    sys.exit(main())
