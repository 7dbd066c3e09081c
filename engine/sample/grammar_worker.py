"""Grammar compiles in worker processes, each stopped when it runs out of time.

A grammar compile is CPU work whose cost the client chooses (an enum of
50,000 strings took 52 s). In a thread it could not be stopped; here it runs
in a child process (``python -m pdfleet.engine.sample.grammar_worker``) that
is killed when its compile passes its time budget, so a compile costs at
most the budget, however large the input. The engine keeps its own
tokenizer description and gets the compiled grammar back as xgrammar's JSON
serialization.

Wire (the child's stdin and stdout, both ways): frames of a length and that
many bytes, whose messages are the carriers of ``contracts/grammar_worker.py``:
the tokenizer (``TokenizerInfo.serialize_json``) once, answered ``READY``; then
one ``CompileRequest`` per compile, answered ``Compiled`` and a frame of the
serialized grammar, ``TooLarge`` or ``Failed``. Nothing is pickled.

Children die with the engine: each reads EOF when the engine goes, and asks
the kernel (Linux ``PR_SET_PDEATHSIG``) for SIGKILL when the thread that
started it ends, so every child is started by one long-lived thread.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import logging
import os
import queue
import re
import select
import signal
import subprocess
import sys
import threading
import time
from typing import Any, BinaryIO

from ..contracts.grammar_worker import (
    FRAME_HEADER,
    READY,
    Compiled,
    CompileRequest,
    Failed,
    TooLarge,
    decode_answer,
    frame,
    frame_size,
    is_ready,
)

logger = logging.getLogger(__name__)

# Seconds a child may take to start (import xgrammar, read the tokenizer).
START_TIMEOUT = 120.0
_LIB_PREFIX = re.compile(r"^\[[0-9:]+\] \S+:\d+: ")
# One thread starts every child and lives as long as the process (see above).
_SPAWNER = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-spawn")


class CompileTimeout(Exception):
    """The compile ran past its budget; its worker was killed."""


class CompileFailed(Exception):
    """The input does not compile (the message says why)."""


class _WorkerDied(Exception):
    """The child ended (or wrote something unreadable) mid-compile."""


class CompiledTooLarge(Exception):
    """The grammar compiled to more than the allowed bytes (``size``)."""

    def __init__(self, size: int) -> None:
        super().__init__(size)
        self.size = size


def lib_message(e: BaseException) -> str:
    """The library's error without its timestamp and C++ source location."""
    text = str(e).strip()
    return _LIB_PREFIX.sub("", text).splitlines()[0] if text else repr(e)


# -- the child ---------------------------------------------------------------------------


def _read_frame(stream: BinaryIO) -> bytes | None:
    head = stream.read(FRAME_HEADER)
    if len(head) < FRAME_HEADER:
        return None
    size = frame_size(head)
    data = stream.read(size)
    return data if len(data) == size else None


def _write_frame(stream: BinaryIO, data: bytes) -> None:
    stream.write(frame(data))


def compile_request(compiler: Any, kind: str, text: str) -> Any:
    """One compile with xgrammar's ``compiler`` (the child runs it)."""
    if kind == "json_schema":
        # Compact separators and no free whitespace: whitespace is never needed,
        # and a model allowed it can spend max_tokens on it.
        return compiler.compile_json_schema(text, any_whitespace=False, strict_mode=True)
    if kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False)
    if kind == "regex":
        return compiler.compile_regex(text)
    if kind == "grammar":
        return compiler.compile_grammar(text)
    if kind == "lark":
        return compiler.compile_lark(text)
    raise ValueError(f"unknown grammar kind {kind!r}")


def main() -> int:
    """The child: compile requests until stdin ends."""
    # The protocol owns the real stdout; anything a library prints goes to stderr.
    out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    inp = sys.stdin.buffer
    import xgrammar as xgr

    first = _read_frame(inp)
    if first is None:
        return 0
    info = xgr.TokenizerInfo.deserialize_json(first.decode())
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    _write_frame(out, READY)
    out.flush()
    while True:
        data = _read_frame(inp)
        if data is None:
            return 0
        request = CompileRequest.decode(data)
        try:
            compiled = compile_request(compiler, request.kind, request.text)
        except Exception as e:  # the library reports bad input as RuntimeError
            _write_frame(out, Failed(lib_message(e)).encode())
            out.flush()
            continue
        size = int(compiled.memory_size_bytes)
        if size > request.max_bytes:
            _write_frame(out, TooLarge(size).encode())
        else:
            grammar = compiled.serialize_json().encode()
            _write_frame(out, Compiled(size).encode())
            _write_frame(out, grammar)
        del compiled
        out.flush()


# -- the engine's side ---------------------------------------------------------------------


def _die_with_parent(parent: int) -> None:
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(1, signal.SIGKILL, 0, 0, 0) != 0:  # PR_SET_PDEATHSIG
        os._exit(126)
    if os.getppid() != parent:
        os._exit(1)


class CompileWorker:
    """One child process (started on first use, restarted after a kill)."""

    def __init__(self, tokenizer_json: bytes) -> None:
        self.tokenizer_json = tokenizer_json
        self.proc: subprocess.Popen[bytes] | None = None
        self.num_started = 0
        self.closed = False
        self._lock = threading.Lock()
        """Held while the child starts (a warm-up and a compile may race)."""

    def ensure_started(self) -> subprocess.Popen[bytes]:
        with self._lock:
            if self.closed:
                raise CompileFailed("the grammar compiler is shut down")
            if self.proc is None or self.proc.poll() is not None:
                self.proc = self._start()
            return self.proc

    def _start(self) -> subprocess.Popen[bytes]:
        from ..contracts.launch import python_module

        parent = os.getpid()

        def start() -> subprocess.Popen[bytes]:
            return subprocess.Popen(
                python_module("pdfleet.engine.sample.grammar_worker"),
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                preexec_fn=lambda: _die_with_parent(parent),
            )

        proc = _SPAWNER.submit(start).result(timeout=60)
        self.num_started += 1
        try:
            self._send(proc, self.tokenizer_json)
            ready = self._receive(proc, time.monotonic() + START_TIMEOUT)
            if not is_ready(ready):
                raise _WorkerDied("it did not start")
        except BaseException as e:
            self._kill(proc)
            if isinstance(e, (_WorkerDied, CompileTimeout, OSError, ValueError)):
                raise CompileFailed(f"the grammar compiler process failed to start ({e})") from None
            raise
        return proc

    @staticmethod
    def _send(proc: subprocess.Popen[bytes], data: bytes) -> None:
        if proc.stdin is None:
            raise RuntimeError("broken invariant: proc.stdin is not None")
        proc.stdin.write(frame(data))
        proc.stdin.flush()

    @staticmethod
    def _read(fd: int, size: int, deadline: float) -> bytes:
        chunks: list[bytes] = []
        left = size
        while left:
            wait = deadline - time.monotonic()
            if wait <= 0:
                raise CompileTimeout
            ready, _, _ = select.select([fd], [], [], wait)
            if not ready:
                raise CompileTimeout
            chunk = os.read(fd, min(left, 1 << 20))
            if not chunk:
                raise _WorkerDied("it exited")
            chunks.append(chunk)
            left -= len(chunk)
        return b"".join(chunks)

    def _receive(self, proc: subprocess.Popen[bytes], deadline: float) -> bytes:
        if proc.stdout is None:
            raise RuntimeError("broken invariant: proc.stdout is not None")
        fd = proc.stdout.fileno()
        size = frame_size(self._read(fd, FRAME_HEADER, deadline))
        return self._read(fd, size, deadline)

    @staticmethod
    def _kill(proc: subprocess.Popen[bytes]) -> None:
        with contextlib.suppress(OSError):
            proc.kill()
        with contextlib.suppress(Exception):
            proc.wait(timeout=10)
        for stream in (proc.stdin, proc.stdout):
            if stream is not None:
                with contextlib.suppress(OSError):
                    stream.close()

    def compile(self, kind: str, text: str, max_bytes: int, timeout: float) -> tuple[bytes, int]:
        """(serialized grammar, its size in bytes); the budget ``timeout`` counts
        from here (a child's start is bounded on its own)."""
        proc = self.ensure_started()
        deadline = time.monotonic() + timeout
        try:
            self._send(proc, CompileRequest(kind, text, max_bytes).encode())
            answer = decode_answer(self._receive(proc, deadline))
            if isinstance(answer, Compiled):
                # The grammar's bytes are the child's work too: the same deadline.
                return self._receive(proc, deadline), answer.size
        except (CompileTimeout, _WorkerDied, OSError, ValueError) as e:
            self.proc = None
            self._kill(proc)
            if isinstance(e, CompileTimeout):
                raise
            raise CompileFailed(f"the grammar compiler process failed ({e})") from None
        if isinstance(answer, TooLarge):
            raise CompiledTooLarge(answer.size)
        raise CompileFailed(answer.error)

    def close(self) -> None:
        with self._lock:  # waits for a start under way: its child is killed too
            self.closed = True
            proc, self.proc = self.proc, None
        if proc is not None:
            self._kill(proc)


class CompilePool:
    """``num_workers`` children; a caller takes an idle one for one compile.

    Thread-safe. Callers (at most ``num_workers`` at once, see the admission
    gate in the server) block in ``compile`` until their compile is done."""

    def __init__(self, tokenizer_json: bytes, num_workers: int) -> None:
        self.workers = [CompileWorker(tokenizer_json) for _ in range(num_workers)]
        self._idle: queue.SimpleQueue[CompileWorker] = queue.SimpleQueue()
        for w in self.workers:
            self._idle.put(w)
        self._lock = threading.Lock()
        self.num_timeouts = 0

    def warm(self) -> None:
        """Start every child in the background (a first compile then waits less)."""

        def start(worker: CompileWorker) -> None:
            try:
                worker.ensure_started()
            except Exception as e:  # a compile will try again and report it
                logger.warning("a grammar compiler process did not start: %s", e)

        for w in self.workers:
            threading.Thread(target=start, args=(w,), name="grammar-warm", daemon=True).start()

    def compile(self, kind: str, text: str, max_bytes: int, timeout: float) -> tuple[bytes, int]:
        worker = self._idle.get()
        try:
            return worker.compile(kind, text, max_bytes, timeout)
        except CompileTimeout:
            with self._lock:
                self.num_timeouts += 1
            raise
        finally:
            self._idle.put(worker)

    def close(self) -> None:
        for w in self.workers:
            w.close()


if __name__ == "__main__":
    sys.exit(main())
