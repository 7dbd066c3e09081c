"""Compile every kernel for Hopper (sm_90) with the launch configurations its
launcher really uses, without a GPU; print one JSON line per compiled launch.

Triton's interpreter runs kernels but never compiles them, so on a machine
without a GPU it misses what only the compiler rejects: unsupported dot
shapes, layout conversions, shared memory over the per-block limit. This
script drives the real launchers on ``meta`` tensors, records each launch
instead of running it, and compiles it with ``triton.compile`` (ptxas ships
with Triton), specialised the way the JIT would be for aligned arguments.

Run with ``TRITON_INTERPRET`` unset: under the interpreter ``@triton.jit``
returns objects the compiler cannot take.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
import time

import torch
import triton
from triton.backends.compiler import BaseBackend, GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import native_specialize_impl

# Modules, not the package's same-named functions (rms_norm, store_kv).
activation = importlib.import_module("pdfleet.kernels.activation")
decode_attention = importlib.import_module("pdfleet.kernels.decode_attention")
prefill_attention = importlib.import_module("pdfleet.kernels.prefill_attention")
rms_norm = importlib.import_module("pdfleet.kernels.rms_norm")
rotary = importlib.import_module("pdfleet.kernels.rotary")
store_kv = importlib.import_module("pdfleet.kernels.store_kv")

KERNELS = {
    activation: ["_silu_and_mul_kernel"],
    decode_attention: ["_decode_split_kernel", "_decode_reduce_kernel"],
    prefill_attention: ["_prefill_kernel"],
    rms_norm: ["_rms_norm_kernel"],
    rotary: ["_rotary_kernel"],
    store_kv: ["_store_kv_kernel"],
}
TARGET = GPUTarget("cuda", 90, 32)
BF16 = torch.bfloat16


class _Recorder:
    def __init__(self, kernel, label_box, launches):
        self.kernel, self.label_box, self.launches = kernel, label_box, launches

    def __getitem__(self, grid):
        def record(*args, **kwargs):
            self.launches.append((self.label_box[0], self.kernel, args, kwargs))

        return record


def _meta(*shape, dtype=BF16):
    return torch.empty(shape, dtype=dtype, device="meta")


def drive_launchers(label_box: list[str]) -> None:
    """Calls each launcher with Llama-like shapes; the recorders keep the launches."""
    i32 = torch.int32
    for head_dim in (64, 128, 256):
        label_box[0] = f"head_dim {head_dim}"
        cache = _meta(4096, 16, 8, head_dim)
        table = _meta(4, 256, dtype=i32)
        qsl, lens = _meta(5, dtype=i32), _meta(4, dtype=i32)
        prefill_attention.paged_prefill_attention(
            _meta(2048, 32, head_dim), cache, cache, table, qsl, lens, 0.1
        )
        q = _meta(4, 32, head_dim)
        decode_attention.paged_decode_attention(q, cache, cache, table, lens, 0.1, num_splits=1)
        decode_attention.paged_decode_attention(q, cache, cache, table, lens, 0.1, num_splits=8)
    for head_dim, block_size in ((80, 16), (96, 1), (112, 64), (192, 256)):
        # Padded head tiles (next power of two, masked), with other block sizes.
        label_box[0] = f"head_dim {head_dim} block_size {block_size}"
        cache = _meta(4096, block_size, 8, head_dim)
        table = _meta(4, 4096 // block_size, dtype=i32)
        prefill_attention.paged_prefill_attention(
            _meta(2048, 32, head_dim), cache, cache, table, qsl, lens, 0.1, sliding_window=1024
        )
        q = _meta(4, 32, head_dim)
        decode_attention.paged_decode_attention(q, cache, cache, table, lens, 0.1, num_splits=8)
        qkv = _meta(256, 48, head_dim)
        rotary.rotary_embedding(
            _meta(256, dtype=torch.int64), qkv[:, :32], qkv[:, 32:40],
            _meta(8192, head_dim, dtype=torch.float32), head_dim,
        )  # fmt: skip
    table = _meta(4, 256, dtype=i32)
    label_box[0] = "sliding window"
    cache = _meta(4096, 32, 8, 128)
    prefill_attention.paged_prefill_attention(
        _meta(2048, 32, 128), cache, cache, table, qsl, lens, 0.1, sliding_window=4096
    )
    decode_attention.paged_decode_attention(
        _meta(4, 32, 128), cache, cache, table, lens, 0.1, sliding_window=4096, num_splits=4
    )
    label_box[0] = "float32"
    cache32 = _meta(512, 16, 8, 128, dtype=torch.float32)
    prefill_attention.paged_prefill_attention(
        _meta(512, 32, 128, dtype=torch.float32), cache32, cache32, table, qsl, lens, 0.1
    )
    decode_attention.paged_decode_attention(
        _meta(4, 32, 128, dtype=torch.float32), cache32, cache32, table, lens, 0.1, num_splits=2
    )
    label_box[0] = "llama-3.1-8b layer ops"
    x = _meta(256, 4096)
    rms_norm.rms_norm(x, _meta(4096), 1e-5)
    rms_norm.fused_add_rms_norm(x, x, _meta(4096), 1e-5)
    qkv = _meta(256, 48, 128)
    rotary.rotary_embedding(
        _meta(256, dtype=torch.int64), qkv[:, :32], qkv[:, 32:40],
        _meta(8192, 128, dtype=torch.float32), 128,
    )  # fmt: skip
    store_kv.store_kv(
        qkv[:, 32:40], qkv[:, 40:], _meta(4096, 16, 8, 128), _meta(4096, 16, 8, 128),
        _meta(256, dtype=torch.int64),
    )  # fmt: skip
    activation.silu_and_mul(_meta(256, 2 * 14336))


def compile_launch(kernel, args, kwargs):
    """``triton.compile`` for sm_90, with the JIT's specialisation: ints equal
    to 1 become constants, aligned pointers and multiples of 16 get divisibility hints."""
    options = {k: kwargs.pop(k) for k in ("num_warps", "num_stages") if k in kwargs}
    values = dict(zip(kernel.arg_names, args, strict=False)) | kwargs
    signature, constants, attrs = {}, {}, {}
    for i, param in enumerate(kernel.params):
        value = values[param.name]
        if param.is_constexpr:
            signature[param.name], constants[param.name] = "constexpr", value
            continue
        kind, spec = native_specialize_impl(BaseBackend, value, False, True, True)
        signature[param.name] = kind
        if kind == "constexpr":
            constants[param.name] = spec
        elif spec and "D" in spec:
            attrs[(i,)] = [["tt.divisibility", 16]]
    source = ASTSource(kernel, signature, constants, attrs)
    return triton.compile(source, target=TARGET, options=options)


def resource_usage(cubin: bytes) -> dict[str, int]:
    tool = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        text = subprocess.run(
            [tool, "-res-usage", f.name], capture_output=True, text=True, timeout=60
        ).stdout
    usage = {}
    for field in text.split():
        key, _, value = field.partition(":")
        if key in ("REG", "STACK", "LOCAL") and value.isdigit():
            usage[key.lower()] = int(value)
    return usage


def compile_row(label: str, kernel, args, kwargs) -> dict:
    constexprs = {k: str(v) for k, v in kwargs.items() if k not in ("num_warps", "num_stages")}
    row = {"case": label, "kernel": kernel.__name__, "constexprs": constexprs}
    row |= {k: kwargs.get(k) for k in ("num_warps", "num_stages")}
    start = time.perf_counter()
    try:
        compiled = compile_launch(kernel, args, dict(kwargs))
    except Exception as e:  # report every failing launch, not just the first
        row["error"] = f"{type(e).__name__}: {e}"[:2000]
    else:
        row["shared_bytes"] = compiled.metadata.shared
        row |= resource_usage(compiled.asm["cubin"])
    row["seconds"] = round(time.perf_counter() - start, 2)
    return row


def main() -> int:
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET to compile", file=sys.stderr)
        return 2
    launches: list = []
    label_box = [""]
    for module, names in KERNELS.items():
        for name in names:
            setattr(module, name, _Recorder(getattr(module, name), label_box, launches))
    drive_launchers(label_box)
    failed = False
    for launch in launches:
        row = compile_row(*launch)
        failed |= "error" in row
        print(json.dumps(row), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
