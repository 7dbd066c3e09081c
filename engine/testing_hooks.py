"""Every test hook of the engine, in one place.

Tests set these environment variables to make error paths happen on demand in
real engine processes. Each hook is off unless its variable is set, and
product code asks here rather than reading the variables itself, so what a
deployment must never set is this list:

- ``$PDFLEET_FAULT_RAISE_ON_TOKEN=ID``: a step that schedules a request whose
  prompt holds token ``ID`` raises, as a model failing on one input would.
- ``$PDFLEET_FAULT_BREAK_ON_TOKEN=ID``: that step and every later one raise,
  as a broken device would.
- ``$PDFLEET_FAULT_STEP_DELAY_FILE=PATH``: every step first sleeps the seconds
  ``PATH`` holds (read each step; missing or empty: none), as a loaded host
  would make it (tests of the gateway's stall detection). An optional second
  number is seconds per scheduled token, slept after the forward pass and
  counted as forward time, as a slower device would take (the engine's
  measured prefill rate falls with it).
- ``$PDFLEET_KV_TEST_READ_DELAY_FILE=PATH``: while ``PATH`` holds a number of
  seconds, every KV READ started is delayed by that much (NIXL: posted late,
  and not cancellable meanwhile; ZMQ: the bytes land late), so tests can
  abort and time out requests mid-pull.
- ``$PDFLEET_TP_TEST_HANG_RANK=R``: tensor-parallel rank ``R`` never joins the
  rendezvous (tests of its bound).
- ``$PDFLEET_LORA_TEST_UNREADABLE=R:NAME``: tensor-parallel rank ``R`` (0 at
  TP = 1) cannot read LoRA adapter ``NAME`` again when a step needs it after
  an eviction (its load reads it as usual), as if only that rank's view of
  the directory had gone.

Torch-free; imports nothing of pdfleet.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

FAULT_TOKEN_ENV = "PDFLEET_FAULT_RAISE_ON_TOKEN"
FAULT_BREAK_ENV = "PDFLEET_FAULT_BREAK_ON_TOKEN"
FAULT_STEP_DELAY_ENV = "PDFLEET_FAULT_STEP_DELAY_FILE"
READ_DELAY_ENV = "PDFLEET_KV_TEST_READ_DELAY_FILE"
TP_HANG_RANK_ENV = "PDFLEET_TP_TEST_HANG_RANK"
LORA_UNREADABLE_ENV = "PDFLEET_LORA_TEST_UNREADABLE"


def _env_token(name: str) -> int | None:
    value = os.environ.get(name, "").strip()
    return int(value) if value.isdigit() else None


@dataclass(frozen=True)
class StepFaults:
    """The step fault hooks, read once when an engine starts."""

    raise_on_token: int | None = None
    break_on_token: int | None = None
    step_delay_file: str | None = None

    @classmethod
    def from_env(cls) -> StepFaults:
        return cls(
            _env_token(FAULT_TOKEN_ENV),
            _env_token(FAULT_BREAK_ENV),
            os.environ.get(FAULT_STEP_DELAY_ENV) or None,
        )

    @property
    def active(self) -> bool:
        return self.raise_on_token is not None or self.break_on_token is not None

    def step_delay(self) -> tuple[float, float]:
        """Seconds this step is to sleep first, and seconds per scheduled token
        its forward pass is to take longer ((0, 0) unless the hook is set)."""
        if not self.step_delay_file:
            return 0.0, 0.0
        try:
            with open(self.step_delay_file) as f:
                words = f.read().split()
            first = max(0.0, float(words[0])) if words else 0.0
            per_token = max(0.0, float(words[1])) if len(words) > 1 else 0.0
        except (OSError, ValueError):
            return 0.0, 0.0
        return first, per_token

    def describe(self) -> str:
        return (
            f"${FAULT_TOKEN_ENV}={self.raise_on_token} ${FAULT_BREAK_ENV}={self.break_on_token} "
            f"${FAULT_STEP_DELAY_ENV}={self.step_delay_file}"
        )


def _seconds_in(path: str) -> float:
    try:
        with open(path) as f:
            return max(0.0, float(f.read().strip() or 0))
    except (OSError, ValueError):
        return 0.0


def kv_read_delay() -> float:
    """Seconds to delay the next KV READ by; 0 unless the hook is set. The file
    is read each time, so a test changes the delay while the engine runs."""
    path = os.environ.get(READ_DELAY_ENV)
    return _seconds_in(path) if path else 0.0


def lora_unreadable(rank: int, name: str) -> bool:
    """Whether rank ``rank`` is to fail reading adapter ``name`` again."""
    value = os.environ.get(LORA_UNREADABLE_ENV)
    return bool(value) and value == f"{rank}:{name}"


def tp_rank_hangs(rank: int) -> bool:
    """Whether tensor-parallel rank ``rank`` is to hang before the rendezvous."""
    return os.environ.get(TP_HANG_RANK_ENV, "") == str(rank)
