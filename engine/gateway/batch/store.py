"""Durable state of the Batch API: files, batches and their requests.

Two stores speak the same SQL:

* :class:`SqliteBatchStore` (``--data-dir``): one SQLite database and a folder
  of files. SQLite allows one writer at a time across processes (WAL mode),
  which is what one gateway (its workers included) needs.
* :class:`PostgresBatchStore` (``$PDFLEET_BATCH_DATABASE_URL``): a PostgreSQL
  database shared by several gateway replicas. File contents live in the
  database, since the replicas share no disk.

Every change is one transaction, so a gateway that stops at any moment comes
back with each batch where it was: requests done stay done (their answers are
in the database); a request that was running goes back to pending and runs
again (at least once: its earlier answer, if it came, was never recorded).

Several replicas run batches at once. A replica claims pending requests
under a lease that it renews while it runs them (rows locked with ``SKIP
LOCKED``, so two replicas never claim one request); the requests of a
replica that stopped go back to pending once their lease ends. One replica at a time finalizes a batch, under a lease of its
own. Output and error files are written when a batch finalizes, from the
database, in input order.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, contextmanager
from pathlib import Path
from typing import Any, Protocol

_TABLES = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes BIGINT NOT NULL, created_at BIGINT NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, data TEXT NOT NULL, created_at BIGINT NOT NULL,
    finalizer TEXT, finalize_until BIGINT NOT NULL DEFAULT 0
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT,
    state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, result TEXT,
    runner TEXT, lease_until BIGINT NOT NULL DEFAULT 0,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS requests_by_state ON requests (state, batch_id);
"""
# Columns added to a database made before the store knew leases: table -> (name, type).
_ADDED = {
    "batches": [("finalizer", "TEXT"), ("finalize_until", "BIGINT NOT NULL DEFAULT 0")],
    "requests": [("runner", "TEXT"), ("lease_until", "BIGINT NOT NULL DEFAULT 0")],
}
# Request states: pending (to run), running, done (an answer: output file),
# failed (an error: error file).
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


# One request line of a batch input file, as stored: (line number, custom_id,
# request body JSON or None, status, error JSON or None).
InputRow = tuple[int, str | None, str | None, str, str | None]
# A row read back: its columns by name.
Row = Mapping[str, Any]


class Cursor(Protocol):
    @property
    def rowcount(self) -> int: ...

    def fetchone(self) -> Any: ...
    def fetchall(self) -> list[Any]: ...


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class BatchStore(ABC):
    """The Batch API's state, over one SQL connection (statements use ``?``)."""

    @abstractmethod
    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        """One statement, in the transaction open on this thread if any."""

    @abstractmethod
    def tx(self) -> AbstractContextManager[None]:
        """A transaction: committed at the end, rolled back on an exception."""

    @abstractmethod
    def close(self) -> None: ...

    # File contents: where they are kept is the store's.
    @abstractmethod
    def _put_content(self, file_id: str, content: bytes) -> None: ...

    @abstractmethod
    def read_file(self, file_id: str) -> bytes: ...

    @abstractmethod
    def _drop_content(self, file_id: str) -> None: ...

    def _claim_lock(self) -> str:
        """The clause that keeps two writers off the same pending rows."""
        return ""

    # -- files ---------------------------------------------------------------------

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        file_id = new_id("file")
        now = int(time.time())
        with self.tx():
            self._put_content(file_id, content)
            self.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, owner, purpose, filename, len(content), now),
            )
        return self.file(owner, file_id) or {}

    def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        row = self.execute(
            "SELECT * FROM files WHERE id = ? AND owner = ?", (file_id, owner)
        ).fetchone()
        return None if row is None else file_object(row)

    def files(
        self, owner: str, purpose: str | None, limit: int, after: str | None
    ) -> list[dict[str, Any]]:
        query, args = "SELECT * FROM files WHERE owner = ?", [owner]
        if purpose:
            query, args = query + " AND purpose = ?", [*args, purpose]
        if after:
            query += " AND (created_at, id) < (SELECT created_at, id FROM files WHERE id = ?)"
            args.append(after)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [file_object(r) for r in self.execute(query, (*args, limit)).fetchall()]

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self.tx():
            gone = self.execute(
                "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).rowcount
            if gone:
                self._drop_content(file_id)
        return bool(gone)

    # -- batches -------------------------------------------------------------------

    def add_batch(self, owner: str, batch: dict[str, Any], lines: list[InputRow]) -> None:
        """A new batch and its requests: (line, custom_id, body JSON or None, state,
        result JSON or None) each; lines that did not parse are failed already."""
        with self.tx():
            self.execute(
                "INSERT INTO batches (id, owner, data, created_at) VALUES (?, ?, ?, ?)",
                (batch["id"], owner, json.dumps(batch), batch["created_at"]),
            )
            self.executemany(
                "INSERT INTO requests (batch_id, line, custom_id, body, state, result) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(batch["id"], *line) for line in lines],
            )

    def executemany(self, sql: str, rows: list[Sequence[Any]]) -> None:
        for row in rows:
            self.execute(sql, row)

    def batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        if owner is None:
            row = self.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = self.execute(
                "SELECT data FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
        return None if row is None else dict(json.loads(row["data"]))

    def owner_of(self, batch_id: str) -> str:
        row = self.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row["owner"]) if row else ""

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        query, args = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after:
            query += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [json.loads(r["data"]) for r in self.execute(query, (*args, limit)).fetchall()]

    def save_batch(self, batch: dict[str, Any]) -> None:
        with self.tx():
            self.execute(
                "UPDATE batches SET data = ? WHERE id = ?", (json.dumps(batch), batch["id"])
            )

    def active_batches(self) -> list[dict[str, Any]]:
        """Batches not yet in a final state, oldest first."""
        rows = self.execute("SELECT owner, data FROM batches ORDER BY created_at, id").fetchall()
        out = []
        for r in rows:
            batch = json.loads(r["data"])
            if batch["status"] in ACTIVE:
                batch["_owner"] = r["owner"]  # the runner's: never stored nor answered
                out.append(batch)
        return out

    def claim_finalize(self, batch_id: str, who: str, lease_s: float) -> bool:
        """True when ``who`` may finalize the batch now: no other replica holds
        it, or the one that did let its lease end (it stopped mid-way)."""
        now = int(time.time())
        with self.tx():
            return bool(
                self.execute(
                    "UPDATE batches SET finalizer = ?, finalize_until = ? WHERE id = ? "
                    "AND (finalizer IS NULL OR finalizer = ? OR finalize_until < ?)",
                    (who, now + int(lease_s), batch_id, who, now),
                ).rowcount
            )

    # -- requests ------------------------------------------------------------------

    def recover(self) -> int:
        """At start: requests a stopped runner left running go back to pending
        (their leases ended; in a single-gateway store, every one)."""
        return self.reclaim()

    def reclaim(self) -> int:
        """Running requests whose lease ended go back to pending."""
        with self.tx():
            return self.execute(
                "UPDATE requests SET state = 'pending' WHERE state = 'running' AND lease_until < ?",
                (int(time.time()),),
            ).rowcount

    def claim(self, batch_id: str, n: int, who: str, lease_s: float) -> list[Row]:
        """Up to ``n`` pending requests of a batch, marked running by ``who``
        until ``lease_s`` from now (:meth:`renew` extends that; once it ends,
        :meth:`reclaim` hands them to another runner)."""
        pending = (
            "SELECT line, custom_id, body, attempts FROM requests "
            "WHERE batch_id = ? AND state = 'pending' ORDER BY line LIMIT ?"
        )
        lock = self._claim_lock()  # a constant clause of the store's own
        until = int(time.time() + lease_s)
        with self.tx():
            rows: list[Row] = self.execute(pending + lock, (batch_id, n)).fetchall()
            self.executemany(
                "UPDATE requests SET state = 'running', attempts = attempts + 1, runner = ?, "
                "lease_until = ? WHERE batch_id = ? AND line = ?",
                [(who, until, batch_id, r["line"]) for r in rows],
            )
        return rows

    def renew(self, who: str, lease_s: float) -> int:
        """The leases of every request ``who`` runs, extended to ``lease_s`` from now."""
        with self.tx():
            return self.execute(
                "UPDATE requests SET lease_until = ? WHERE state = 'running' AND runner = ?",
                (int(time.time() + lease_s), who),
            ).rowcount

    def finish(self, batch_id: str, line: int, state: str, result: dict[str, Any] | None) -> None:
        with self.tx():
            self.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ?",
                (state, None if result is None else json.dumps(result), batch_id, line),
            )

    def counts(self, batch_id: str) -> dict[str, int]:
        rows = self.execute(
            "SELECT state, COUNT(*) AS n FROM requests WHERE batch_id = ? GROUP BY state",
            (batch_id,),
        ).fetchall()
        return {r["state"]: int(r["n"]) for r in rows}

    def fail_pending(self, batch_id: str, code: str, message: str) -> None:
        """Every request not yet run fails with ``code`` (cancelled, expired)."""
        rows = self.execute(
            "SELECT line, custom_id FROM requests WHERE batch_id = ? AND state = 'pending'",
            (batch_id,),
        ).fetchall()
        for r in rows:
            self.finish(batch_id, r["line"], "failed", line_error(r["custom_id"], code, message))

    def results(self, batch_id: str, state: str) -> list[str]:
        """The JSONL lines of the requests in ``state`` (done or failed), in input order."""
        rows = self.execute(
            "SELECT result FROM requests WHERE batch_id = ? AND state = ? ORDER BY line",
            (batch_id, state),
        ).fetchall()
        return [r["result"] for r in rows]

    def pending_demand(self) -> dict[str, int]:
        """Requests of active batches by state (pending, running): deferrable demand."""
        rows = self.execute(
            "SELECT state, COUNT(*) AS n FROM requests WHERE state IN ('pending', 'running') "
            "GROUP BY state"
        ).fetchall()
        return {r["state"]: int(r["n"]) for r in rows}


class SqliteBatchStore(BatchStore):
    """One gateway's store: SQLite and a folder of files in ``data_dir``."""

    def __init__(self, data_dir: str) -> None:
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One connection; calls come from the API's and the runner's database
        # threads, never from the event loop, and the lock keeps a transaction
        # to the thread that opened it.
        self.db = sqlite3.connect(
            str(self.dir / "batches.sqlite3"),
            timeout=30,
            isolation_level=None,
            check_same_thread=False,
        )
        self.db.row_factory = sqlite3.Row
        self.lock = threading.RLock()
        self.db.execute("PRAGMA journal_mode=WAL")
        # Each commit survives the process (what a gateway restart needs); a
        # power loss may take the last commits back (the host's own sync).
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(_TABLES)
        for table, columns in _ADDED.items():
            have = {r["name"] for r in self.db.execute(f"PRAGMA table_info({table})")}
            for name, kind in columns:
                if name not in have:
                    self.db.execute(f"ALTER TABLE {table} ADD COLUMN {name} {kind}")

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        with self.lock:
            return self.db.execute(sql, tuple(args))

    def executemany(self, sql: str, rows: list[Sequence[Any]]) -> None:
        with self.lock:
            self.db.executemany(sql, rows)

    @contextmanager
    def tx(self) -> Iterator[None]:
        with self.lock:
            self.db.execute("BEGIN IMMEDIATE")
            try:
                yield
            except BaseException:
                self.db.execute("ROLLBACK")
                raise
            self.db.execute("COMMIT")

    def close(self) -> None:
        self.db.close()

    def recover(self) -> int:
        # One gateway owns this database: whatever was running when it stopped
        # runs again, leases or not.
        with self.tx():
            return self.execute(
                "UPDATE requests SET state = 'pending' WHERE state = 'running'"
            ).rowcount

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def _put_content(self, file_id: str, content: bytes) -> None:
        # Written under a temporary name and renamed before the row is committed:
        # a recorded file always has its bytes.
        tmp = self.files_dir / f".{file_id}.tmp"
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path_of(file_id))

    def read_file(self, file_id: str) -> bytes:
        return self.path_of(file_id).read_bytes()

    def _drop_content(self, file_id: str) -> None:
        self.path_of(file_id).unlink(missing_ok=True)


class PostgresBatchStore(BatchStore):
    """The store of several gateway replicas: one PostgreSQL database (file
    contents included). The URL is a libpq one (``postgresql://user:pass@host/db``)."""

    def __init__(self, url: str, connect_timeout: int = 10) -> None:
        # psycopg is the `batch-postgres` extra: imported only by this store.
        import psycopg
        from psycopg.rows import dict_row

        def connect() -> psycopg.Connection[dict[str, Any]]:
            return psycopg.connect(
                url, autocommit=True, row_factory=dict_row, connect_timeout=connect_timeout
            )

        self._connect = connect
        self.conn = connect()
        # One connection, one transaction at a time: the lock keeps another
        # thread's statements out of an open transaction.
        self.lock = threading.RLock()
        with self.tx():
            # Replicas starting together create the schema one after another.
            self.conn.execute("SELECT pg_advisory_xact_lock(hashtext('pdfleet-batch-schema'))")
            self.conn.execute(_TABLES.encode())
            self.conn.execute(
                b"CREATE TABLE IF NOT EXISTS file_data (id TEXT PRIMARY KEY, content BYTEA NOT NULL)"
            )
            for table, columns in _ADDED.items():
                for name, kind in columns:
                    self.conn.execute(
                        f"ALTER TABLE {table} ADD COLUMN IF NOT EXISTS {name} {kind}".encode()
                    )

    def _live(self) -> Any:
        """The connection, made again when the server dropped it (outside a
        transaction only: an open one failed with it)."""
        if self.conn.closed or self.conn.broken:
            self.conn = self._connect()
        return self.conn

    def execute(self, sql: str, args: Sequence[Any] = ()) -> Cursor:
        with self.lock:
            cursor: Cursor = self._live().execute(sql.replace("?", "%s").encode(), tuple(args))
            return cursor

    def executemany(self, sql: str, rows: list[Sequence[Any]]) -> None:
        with self.lock, self._live().cursor() as cursor:
            cursor.executemany(sql.replace("?", "%s").encode(), rows)

    @contextmanager
    def tx(self) -> Iterator[None]:
        with self.lock, self._live().transaction():
            yield

    def close(self) -> None:
        with self.lock:
            self.conn.close()

    def _claim_lock(self) -> str:
        # Another replica's claim skips the rows this one is claiming.
        return " FOR UPDATE SKIP LOCKED"

    def _put_content(self, file_id: str, content: bytes) -> None:
        self.execute("INSERT INTO file_data VALUES (?, ?)", (file_id, content))

    def read_file(self, file_id: str) -> bytes:
        row = self.execute("SELECT content FROM file_data WHERE id = ?", (file_id,)).fetchone()
        if row is None:
            raise FileNotFoundError(file_id)
        return bytes(row["content"])

    def _drop_content(self, file_id: str) -> None:
        self.execute("DELETE FROM file_data WHERE id = ?", (file_id,))


def open_store(data_dir: str | None, database_url: str | None) -> BatchStore | None:
    """The Batch API's store: PostgreSQL when a database URL is given, else
    SQLite in ``data_dir``; None when neither is (no Batch API)."""
    if database_url:
        return PostgresBatchStore(database_url)
    if data_dir:
        return SqliteBatchStore(data_dir)
    return None


def file_object(row: Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": int(row["bytes"]),
        "created_at": int(row["created_at"]),
        "filename": row["filename"],
        "purpose": row["purpose"],
        "status": "processed",
        "status_details": None,
        "expires_at": None,
    }


def line_error(
    custom_id: str | None, code: str, message: str, line: int | None = None
) -> dict[str, Any]:
    """One line of an error file: a request that produced no answer."""
    error: dict[str, Any] = {"code": code, "message": message}
    if line is not None:
        error["line"] = line
    return {
        "id": new_id("batch_req"),
        "custom_id": custom_id,
        "response": None,
        "error": error,
    }
