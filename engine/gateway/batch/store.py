"""Durable state of the Batch API: one SQLite database and a folder of files.

Every change is one transaction, so a gateway that stops at any moment comes
back with each batch where it was: requests done stay done (their answers are
in the database), a request that was running goes back to pending and runs
again (at least once: its earlier answer, if it came, was never recorded).
Uploaded files are written to a temporary name and renamed, then recorded.
Output and error files are written when a batch finalizes, from the
database, in input order.

SQLite allows one writer at a time across processes (WAL mode), which is
what one gateway (its workers included) needs; several gateway replicas
need a shared database server, which this store does not speak.
"""

from __future__ import annotations

import json
import os
import secrets
import sqlite3
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, purpose TEXT NOT NULL, filename TEXT NOT NULL,
    bytes INTEGER NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, owner TEXT NOT NULL, data TEXT NOT NULL, created_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS requests (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, custom_id TEXT, body TEXT,
    state TEXT NOT NULL, attempts INTEGER NOT NULL DEFAULT 0, result TEXT,
    PRIMARY KEY (batch_id, line)
);
CREATE INDEX IF NOT EXISTS requests_by_state ON requests (state, batch_id);
"""
# Request states: pending (to run), running, done (an answer: output file),
# failed (an error: error file).
ACTIVE = ("validating", "in_progress", "finalizing", "cancelling")


# One request line of a batch input file, as stored: (line number, custom_id,
# request body JSON or None, status, error JSON or None).
InputRow = tuple[int, str | None, str | None, str, str | None]


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


class BatchStore:
    def __init__(self, data_dir: str) -> None:
        self.dir = Path(data_dir)
        self.files_dir = self.dir / "files"
        self.files_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        # One connection, used by one thread at a time (the API's and the
        # runner's single database thread), so never by the event loop.
        self.db = sqlite3.connect(
            str(self.dir / "batches.sqlite3"),
            timeout=30,
            isolation_level=None,
            check_same_thread=False,
        )
        self.db.row_factory = sqlite3.Row
        self.db.execute("PRAGMA journal_mode=WAL")
        # Each commit survives the process (what a gateway restart needs); a
        # power loss may take the last commits back (the host's own sync).
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)

    def close(self) -> None:
        self.db.close()

    @contextmanager
    def tx(self) -> Iterator[sqlite3.Connection]:
        self.db.execute("BEGIN IMMEDIATE")
        try:
            yield self.db
        except BaseException:
            self.db.execute("ROLLBACK")
            raise
        self.db.execute("COMMIT")

    # -- files ---------------------------------------------------------------------

    def path_of(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, owner: str, purpose: str, filename: str, content: bytes) -> dict[str, Any]:
        file_id = new_id("file")
        tmp = self.files_dir / f".{file_id}.tmp"
        with open(tmp, "wb") as f:
            f.write(content)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.path_of(file_id))
        now = int(time.time())
        with self.tx() as db:
            db.execute(
                "INSERT INTO files VALUES (?, ?, ?, ?, ?, ?)",
                (file_id, owner, purpose, filename, len(content), now),
            )
        return self.file(owner, file_id) or {}

    def file(self, owner: str, file_id: str) -> dict[str, Any] | None:
        row = self.db.execute(
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
        return [file_object(r) for r in self.db.execute(query, (*args, limit))]

    def delete_file(self, owner: str, file_id: str) -> bool:
        with self.tx() as db:
            gone = db.execute(
                "DELETE FROM files WHERE id = ? AND owner = ?", (file_id, owner)
            ).rowcount
        if gone:
            self.path_of(file_id).unlink(missing_ok=True)
        return bool(gone)

    # -- batches -------------------------------------------------------------------

    def add_batch(self, owner: str, batch: dict[str, Any], lines: list[InputRow]) -> None:
        """A new batch and its requests: (line, custom_id, body JSON or None, state,
        result JSON or None) each; lines that did not parse are failed already."""
        with self.tx() as db:
            db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?)",
                (batch["id"], owner, json.dumps(batch), batch["created_at"]),
            )
            db.executemany(
                "INSERT INTO requests (batch_id, line, custom_id, body, state, result) "
                "VALUES (?, ?, ?, ?, ?, ?)",
                [(batch["id"], *line) for line in lines],
            )

    def batch(self, owner: str | None, batch_id: str) -> dict[str, Any] | None:
        if owner is None:
            row = self.db.execute("SELECT data FROM batches WHERE id = ?", (batch_id,)).fetchone()
        else:
            row = self.db.execute(
                "SELECT data FROM batches WHERE id = ? AND owner = ?", (batch_id, owner)
            ).fetchone()
        return None if row is None else json.loads(row["data"])

    def owner_of(self, batch_id: str) -> str:
        row = self.db.execute("SELECT owner FROM batches WHERE id = ?", (batch_id,)).fetchone()
        return str(row["owner"]) if row else ""

    def batches(self, owner: str, limit: int, after: str | None) -> list[dict[str, Any]]:
        query, args = "SELECT data FROM batches WHERE owner = ?", [owner]
        if after:
            query += " AND (created_at, id) < (SELECT created_at, id FROM batches WHERE id = ?)"
            args.append(after)
        query += " ORDER BY created_at DESC, id DESC LIMIT ?"
        return [json.loads(r["data"]) for r in self.db.execute(query, (*args, limit))]

    def save_batch(self, batch: dict[str, Any]) -> None:
        with self.tx() as db:
            db.execute("UPDATE batches SET data = ? WHERE id = ?", (json.dumps(batch), batch["id"]))

    def active_batches(self) -> list[dict[str, Any]]:
        """Batches not yet in a final state, oldest first."""
        rows = self.db.execute("SELECT owner, data FROM batches ORDER BY created_at, id")
        out = []
        for r in rows:
            batch = json.loads(r["data"])
            if batch["status"] in ACTIVE:
                batch["_owner"] = r["owner"]  # the runner's: never stored nor answered
                out.append(batch)
        return out

    # -- requests ------------------------------------------------------------------

    def recover(self) -> int:
        """At start: requests left running by a stopped gateway run again."""
        with self.tx() as db:
            return db.execute(
                "UPDATE requests SET state = 'pending' WHERE state = 'running'"
            ).rowcount

    def claim(self, batch_id: str, n: int) -> list[sqlite3.Row]:
        """Up to ``n`` pending requests of a batch, marked running."""
        with self.tx() as db:
            rows = db.execute(
                "SELECT line, custom_id, body, attempts FROM requests "
                "WHERE batch_id = ? AND state = 'pending' ORDER BY line LIMIT ?",
                (batch_id, n),
            ).fetchall()
            db.executemany(
                "UPDATE requests SET state = 'running', attempts = attempts + 1 "
                "WHERE batch_id = ? AND line = ?",
                [(batch_id, r["line"]) for r in rows],
            )
        return rows

    def finish(self, batch_id: str, line: int, state: str, result: dict[str, Any] | None) -> None:
        with self.tx() as db:
            db.execute(
                "UPDATE requests SET state = ?, result = ? WHERE batch_id = ? AND line = ?",
                (state, None if result is None else json.dumps(result), batch_id, line),
            )

    def counts(self, batch_id: str) -> dict[str, int]:
        rows = self.db.execute(
            "SELECT state, COUNT(*) AS n FROM requests WHERE batch_id = ? GROUP BY state",
            (batch_id,),
        )
        return {r["state"]: int(r["n"]) for r in rows}

    def fail_pending(self, batch_id: str, code: str, message: str) -> None:
        """Every request not yet run fails with ``code`` (cancelled, expired)."""
        rows = self.db.execute(
            "SELECT line, custom_id FROM requests WHERE batch_id = ? AND state = 'pending'",
            (batch_id,),
        ).fetchall()
        for r in rows:
            self.finish(batch_id, r["line"], "failed", line_error(r["custom_id"], code, message))

    def results(self, batch_id: str, state: str) -> Iterator[str]:
        """The JSONL lines of the requests in ``state`` (done or failed), in input order."""
        rows = self.db.execute(
            "SELECT result FROM requests WHERE batch_id = ? AND state = ? ORDER BY line",
            (batch_id, state),
        )
        for r in rows:
            yield r["result"]

    def pending_demand(self) -> dict[str, int]:
        """Requests of active batches by state (pending, running): deferrable demand."""
        rows = self.db.execute(
            "SELECT state, COUNT(*) AS n FROM requests WHERE state IN ('pending', 'running') "
            "GROUP BY state"
        )
        return {r["state"]: int(r["n"]) for r in rows}


def file_object(row: sqlite3.Row) -> dict[str, Any]:
    return {
        "id": row["id"],
        "object": "file",
        "bytes": row["bytes"],
        "created_at": row["created_at"],
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
