"""Fetching an ``hf://ORG/NAME`` LoRA adapter when it is loaded at run time.

The engine runs the same command as the operator's adapter init container and
``pdfleet up`` (``pdfleet fetch-model URI --adapter``, models/sources/hub.py),
as a child process so a slow or hung download can be killed at its deadline:
it reads the token from ``HF_TOKEN``/``HF_TOKEN_PATH`` and the endpoint from
``HF_ENDPOINT``, downloads only ``adapter_config.json`` and
``adapter_model.safetensors`` into the Hugging Face cache (``HF_HUB_CACHE``:
the operator points it at the pod's cache volume), checks a pinned commit, and
prints the snapshot directory the engine then reads like any other adapter.
A failure raises :class:`LoRAError` naming the adapter and the fetch's reason;
nothing changes in the engine.
"""

from __future__ import annotations

import asyncio
import contextlib

from ..contracts.launch import python_module
from ..contracts.model_source import HF_SCHEME, parse_hf_uri
from .adapter import LoRAError

FETCH_TIMEOUT_SECONDS = 600.0
"""How long one adapter download may take before it is killed."""


def is_hub_source(path: str) -> bool:
    return path.startswith(f"{HF_SCHEME}://")


async def fetch_hub_adapter(
    name: str,
    source: str,
    revision: str | None = None,
    timeout: float = FETCH_TIMEOUT_SECONDS,  # noqa: ASYNC109 (kills the child at the deadline)
) -> str:
    """Download ``source`` (``hf://ORG/NAME``) at ``revision``; return its local
    directory. Raises LoRAError naming ``name`` when the source is malformed,
    the download fails or it takes longer than ``timeout`` seconds."""
    # parse_hf_uri also takes a model's hf://ORG/NAME/FILE.gguf, which an
    # adapter never is: one message for both malformed shapes.
    try:
        hub = parse_hf_uri(source)
    except ValueError:
        hub = None
    if hub is None or hub.filename is not None:
        raise LoRAError(
            f"LoRA adapter {name!r}: {source!r}: an adapter is a Hub repository, hf://ORG/NAME"
        )
    command = python_module("pdfleet.engine.cli", "fetch-model", source, "--adapter")
    if revision:
        command += ["--revision", revision]
    child = await asyncio.create_subprocess_exec(
        *command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    try:
        out, err = await asyncio.wait_for(child.communicate(), timeout)
    except asyncio.CancelledError:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        raise
    except TimeoutError:
        with contextlib.suppress(ProcessLookupError):
            child.kill()
        await child.wait()
        raise LoRAError(
            f"LoRA adapter {name!r}: fetching {source} took longer than {timeout:g} s"
        ) from None
    if child.returncode != 0:
        # The fetch ends with one line saying why (models/sources/hub.py _explain).
        lines = [line for line in err.decode(errors="replace").splitlines() if line.strip()]
        reason = lines[-1].strip() if lines else f"exit status {child.returncode}"
        raise LoRAError(f"LoRA adapter {name!r}: cannot fetch {source}: {reason[:500]}")
    printed = out.decode(errors="replace").strip().splitlines()
    if not printed:
        raise LoRAError(f"LoRA adapter {name!r}: fetching {source} printed no directory")
    return printed[-1]
