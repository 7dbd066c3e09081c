"""What `pdfleet up` prints once the fleet is ready: the API-key warning, sample
requests that work as printed (with the key header when keys are set, never a
key), and the fleet's memory."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from helpers.server import wait_until
from helpers.up import children_of

from pdfleet.operator.local.cli import kv_cache_tokens, usage_lines
from pdfleet.operator.local.process import resident_bytes

URL = "http://127.0.0.1:8000"


def test_without_keys_it_warns_that_anyone_who_reaches_the_gateway_may_use_it():
    text = usage_lines(URL, "m", [], {})
    assert text.startswith("warning: no API key: anyone who can reach http://127.0.0.1:8000")
    assert "PDFLEET_API_KEY" in text
    assert "Authorization" not in text  # nothing to send


def test_one_key_from_the_environment_is_named_by_its_variable_never_printed():
    text = usage_lines(URL, "m", ["sk-secret-1"], {"PDFLEET_API_KEY": "sk-secret-1"})
    assert "sk-secret-1" not in text
    assert text.count('-H "Authorization: Bearer $PDFLEET_API_KEY"') == 2
    assert "warning" not in text


def test_several_keys_or_a_key_file_get_a_placeholder_and_where_to_find_one():
    for keys, env, where in (
        (["ka", "kb"], {"PDFLEET_API_KEY": "ka,kb"}, "PDFLEET_API_KEY"),
        (["kf"], {"PDFLEET_API_KEY_FILE": "/run/keys"}, "$PDFLEET_API_KEY_FILE"),
    ):
        text = usage_lines(URL, "m", keys, env)
        assert text.count('-H "Authorization: Bearer $KEY"') == 2
        assert "set KEY to one of the API keys in" in text and where in text
        assert not any(k in text.replace("$KEY", "") for k in keys if len(k) > 1)


def test_kv_cache_tokens_come_from_the_cache_config_series():
    text = (
        'vllm:cache_config_info{block_size="16",num_gpu_blocks="182",cache_dtype="float32",'
        'enable_prefix_caching="True",compat_hash="x",prefix_caching_hash_algo="sha256"} 1.0\n'
    )
    assert kv_cache_tokens(text) == 16 * 182
    assert kv_cache_tokens(None) is None
    assert kv_cache_tokens("other_metric 1\n") is None


def test_resident_bytes_count_a_process_and_everything_below_it():
    grandchild = "import time; b = bytearray(64 << 20); time.sleep(60)"
    code = (
        "import subprocess, sys, time; "
        f"subprocess.Popen([sys.executable, '-c', {grandchild!r}]); time.sleep(60)"
    )
    parent = subprocess.Popen([sys.executable, "-c", code])
    try:
        # The grandchild holds 64 MiB of touched memory once it runs.
        assert wait_until(lambda: resident_bytes(parent.pid) > 64 << 20, 30, 0.1)
        assert resident_bytes(parent.pid, tree=False) < 64 << 20
    finally:
        for child in children_of(parent.pid):
            os.kill(child, signal.SIGKILL)
        parent.kill()
        parent.wait(10)
    assert resident_bytes(parent.pid) == 0
