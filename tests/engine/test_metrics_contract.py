"""The metrics contract (engine/contracts/metrics.py): names are written once, the
engine exports what it declares, and the one parser reads what consumers need."""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from pdfleet.engine.contracts import metrics as m
from pdfleet.engine.gateway.engines import parse_engine_metrics
from pdfleet.engine.gateway.metrics import GatewayMetrics
from pdfleet.engine.metrics import EngineMetrics

ROOT = Path(__file__).resolve().parents[2]
CONTRACT = ROOT / "engine" / "contracts" / "metrics.py"
# A metric name, or the start of one that code would concatenate.
METRIC_NAME = re.compile(r"(pdfleet_(engine|gateway|operator|autoscaler)_|vllm:)[a-z0-9_:]*")


def contract_metrics() -> list[m.Metric]:
    return [v for v in vars(m).values() if isinstance(v, m.Metric)]


def engine_config(kv_connector: str | None) -> SimpleNamespace:
    """The fields EngineMetrics reads of an EngineConfig."""
    return SimpleNamespace(
        model_config=SimpleNamespace(name="tiny"),
        cache_config=SimpleNamespace(
            block_size=16,
            num_gpu_blocks=64,
            enable_prefix_caching=True,
            prefix_caching_hash_algo="sha256",
        ),
        scheduler_config=SimpleNamespace(max_num_batched_tokens=2048, max_num_seqs=8),
        kv_cache_dtype="auto",
        compat_hash=lambda: "c0ffee",
        resume_identity=lambda: "5eed",
        kv_transfer_config=SimpleNamespace(kv_connector=kv_connector) if kv_connector else None,
        lora_config=SimpleNamespace(max_loras=2) if kv_connector else None,
    )


def exported_families(registry: CollectorRegistry) -> set[str]:
    scrape = m.parse_metrics(generate_latest(registry).decode())
    return set(scrape.samples)


def test_no_metric_name_is_written_outside_the_contract():
    offenders = []
    for folder in ("engine", "operator", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == CONTRACT:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                if (
                    isinstance(node, ast.Constant)
                    and isinstance(node.value, str)
                    and METRIC_NAME.fullmatch(node.value)
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {node.value}")
    assert not offenders, "metric names belong in engine/contracts/metrics.py:\n" + "\n".join(
        offenders
    )


def test_label_names_are_read_and_written_through_the_contract():
    """A label a reader selects by, or a writer names, is the contract's
    constant: ``labels.get("role")``, ``labels["block_size"]`` or
    ``.labels(finished_reason=...)`` outside it would drift apart silently."""
    names = {n for metric in contract_metrics() for n in metric.labels}
    names |= set(m.CACHE_CONFIG_LABELS)
    offenders = []
    for folder in ("engine", "operator"):
        for path in (ROOT / folder).rglob("*.py"):
            if path == CONTRACT:
                continue
            for node in ast.walk(ast.parse(path.read_text())):
                literal = None
                if (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "get"
                    and isinstance(node.func.value, ast.Name)
                    and "label" in node.func.value.id
                    and node.args
                    and isinstance(node.args[0], ast.Constant)
                ):
                    literal = node.args[0].value
                elif (
                    isinstance(node, ast.Subscript)
                    and isinstance(node.value, ast.Name)
                    and "label" in node.value.id
                    and isinstance(node.slice, ast.Constant)
                ):
                    literal = node.slice.value
                elif (
                    isinstance(node, ast.Call)
                    and isinstance(node.func, ast.Attribute)
                    and node.func.attr == "labels"
                ):
                    literal = next((k.arg for k in node.keywords if k.arg in names), None)
                if literal in names:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}: {literal}")
    assert not offenders, "label names belong in engine/contracts/metrics.py:\n" + "\n".join(
        offenders
    )


def test_contract_names_are_unique():
    names = [metric.name for metric in contract_metrics()]
    assert len(names) == len(set(names))


@pytest.mark.parametrize(
    ("name", "kind"),
    [("x_requests", "counter"), ("x_config", "info")],
)
def test_counter_and_info_names_must_carry_their_exposed_suffix(name, kind):
    with pytest.raises(ValueError, match="must end in"):
        m.Metric(name, kind, "help")


def test_histograms_and_only_histograms_take_buckets():
    with pytest.raises(ValueError, match="buckets"):
        m.Metric("x_seconds", "histogram", "help")
    with pytest.raises(ValueError, match="buckets"):
        m.Metric("x_ratio", "gauge", "help", buckets=(1.0,))


def test_engine_exports_every_declared_series_under_both_names():
    metrics = EngineMetrics(engine_config("NixlConnector"))
    metrics.request_success.labels(model_name="tiny", finished_reason="stop").inc()
    for family in metrics.peer_pulls:  # labelled by producer as pulls complete
        family.labels(model_name="tiny", producer="p").inc()
    metrics.lora_requests.labels(model_name="tiny", lora_name="a").inc()
    metrics.adapter_info.labels(
        model_name="tiny", lora_name="a", lora_identity="a@0", lora_path="/a"
    ).set(1)
    metrics._update_resident({"a": "device"})
    exported = exported_families(metrics.registry)
    engine = [
        x
        for x in contract_metrics()
        if x.name.startswith("pdfleet_engine_") or x.name.startswith("vllm:")
    ]
    vllm_read_only = {m.VLLM_PROMPT_TOKENS, m.VLLM_TTFT, m.VLLM_ITL}
    for metric in engine:
        sample = metric.count if metric.kind == "histogram" else metric.name
        if metric in vllm_read_only:
            assert sample not in exported, f"{metric.name} is read from vLLM, not exported"
        else:
            assert sample in exported, f"{metric.name} is declared but not exported"
    for native in m.VLLM_EXPORTED:
        assert m.VLLM_ALIASES[native].labels == native.labels


def test_engine_without_connector_exports_no_kv_transfer_series():
    exported = exported_families(EngineMetrics(engine_config(None)).registry)
    assert m.ENGINE_NUM_REQUESTS_RUNNING.name in exported
    assert not [n for n in exported if "kv_transfer" in n and "held" not in n]
    assert m.VLLM_NIXL_NUM_FAILED_TRANSFERS.name not in exported


def test_gateway_exports_every_gateway_series():
    metrics = GatewayMetrics()
    metrics.requests.labels("/v1/completions", "200").inc()
    metrics.ttft.labels("/v1/completions").observe(0.1)
    metrics.e2e.labels("/v1/completions").observe(0.2)
    metrics.decisions.labels("decode_only", "short_prompt").inc()
    metrics.retries.labels("prefill").inc()
    metrics.fallbacks.labels("prefill_failed").inc()
    metrics.upstream_errors.labels("http://e", "decode", "connect").inc()
    metrics.engine_healthy.labels("http://e", "decode").set(1)
    metrics.engine_inflight.labels("http://e", "decode").set(2)
    metrics.ejections.labels("http://e", "decode").inc()
    metrics.stalls.labels("http://e", "decode").inc()
    metrics.stall_limit.labels("http://e", "decode").set(5)
    metrics.capacity.labels("http://e", "decode").set(8)
    metrics.queued.set(0)
    metrics.kv_pair_open.labels("http://p", "http://e").set(1)
    metrics.held.set(0)
    metrics.rejected.labels("invalid_json").inc()
    metrics.kv_index_events.labels("http://e", "BlockStored").inc()
    metrics.kv_index_replays.labels("http://e", "ok").inc()
    metrics.kv_index_resets.labels("http://e", "restart").inc()
    metrics.kv_index_fresh.labels("http://e").set(1)
    metrics.activations.labels("decode").inc()
    metrics.peer_pull_decisions.labels("pull", "cost").inc()
    metrics.peer_pull_crossover.labels("http://h", "http://e").set(100)
    metrics.peer_pull_bandwidth.labels("http://h", "http://e").set(1e9)
    metrics.peer_pull_prefill_rate.labels("http://e").set(1e4)
    metrics.peer_pull_lend_seconds.labels("http://h").set(0.01)
    metrics.tenant_requests.labels("t", "admitted").inc()
    metrics.tenant_tokens.labels("t").inc(10)
    metrics.tenant_inflight.labels("t").set(1)
    metrics.tenant_inflight_tokens.labels("t").set(10)
    metrics.tenant_queued.labels("t").set(0)
    metrics.tenant_queue_seconds.labels("t").observe(0.1)
    metrics.batch_requests.labels("pending").set(0)
    metrics.lora_loads.labels("http://e").inc()
    metrics.lora_identity_conflicts.labels("a").set(0)
    metrics.migrations.labels("drain").inc()
    exported = exported_families(metrics.registry)
    for metric in contract_metrics():
        if metric.name.startswith("pdfleet_gateway_"):
            sample = metric.count if metric.kind == "histogram" else metric.name
            assert sample in exported, metric.name


def test_gateway_reads_its_routing_inputs_from_an_engine_scrape():
    metrics = EngineMetrics(engine_config(None))
    labels = metrics.labels
    metrics._series[m.ENGINE_NUM_REQUESTS_WAITING][0].set(3)
    metrics._series[m.ENGINE_NUM_REQUESTS_RUNNING][0].set(5)
    metrics._series[m.ENGINE_KV_CACHE_USAGE][0].set(0.25)
    assert labels == {"model_name": "tiny"}
    load = parse_engine_metrics(generate_latest(metrics.registry).decode())
    assert (load.waiting, load.running, load.kv_usage) == (3, 5, 0.25)
    assert (load.compat_hash, load.block_size) == ("c0ffee", 16)
    assert load.resume_identity == "5eed"
    assert load.step_token_budget == 2048  # peer pulls: what a lend shares a step with
    assert load.max_num_seqs == 8


def test_parser_falls_back_to_vllm_names_and_sums_label_sets():
    text = (
        'vllm:num_requests_waiting{model_name="a"} 2\n'
        'vllm:num_requests_waiting{model_name="b"} 4\n'
        'vllm:kv_cache_usage_perc{model_name="a"} 0.2\n'
        'vllm:kv_cache_usage_perc{model_name="b"} 0.6\n'
    )
    scrape = m.parse_metrics(text)
    assert scrape.total(*m.names(m.ENGINE_NUM_REQUESTS_WAITING)) == 6
    assert scrape.mean(*m.names(m.ENGINE_KV_CACHE_USAGE)) == pytest.approx(0.4)
    assert scrape.total(*m.names(m.ENGINE_NUM_REQUESTS_RUNNING)) is None
    assert scrape.labels("vllm:num_requests_waiting") == {"model_name": "a"}


def test_parser_keeps_only_the_requested_lines_and_totals_drop_buckets():
    metrics = EngineMetrics(engine_config(None))
    metrics._series[m.ENGINE_TTFT][0].observe(0.05)
    text = generate_latest(metrics.registry).decode()
    totals = m.parse_metrics(text).totals()
    assert totals[m.ENGINE_TTFT.count] == 1
    assert not [n for n in totals if n.endswith(("_bucket", "_created"))]
    only = m.parse_metrics(text, only=[m.ENGINE_TTFT.count])
    assert set(only.samples) == {m.ENGINE_TTFT.count}


def test_parser_rejects_text_that_is_not_prometheus_exposition():
    with pytest.raises(ValueError, match="unreadable Prometheus metrics text"):
        m.parse_metrics('pdfleet_engine_num_requests_running{model_name="x" 1\n')


def test_docs_list_every_series():
    page = (ROOT / "docs" / "metrics.md").read_text()
    missing = [x.name for x in contract_metrics() if f"`{x.name}`" not in page]
    assert not missing, f"add to docs/metrics.md: {missing}"


def test_the_lock_free_histograms_expose_what_prometheus_client_would():
    """The gateway's request-path histograms (public collector API) write the
    exposition a prometheus_client Histogram of the same metric writes for
    the same observations, ``_created`` aside (its value is the clock)."""
    import re

    from prometheus_client import CollectorRegistry

    ours, reference = GatewayMetrics(), CollectorRegistry()
    ttft = m.GATEWAY_TTFT.create(reference)
    resume = m.GATEWAY_MIGRATION_RESUME.create(reference)
    ttft.labels("/v1/chat/completions")  # a series at 0 is exported in both
    ours.ttft.labels("/v1/chat/completions")
    for value in (0.0, 0.001, 0.1, 0.1, 2.5, 1e9):
        ttft.labels("/v1/completions").observe(value)
        ours.ttft.labels("/v1/completions").observe(value)
        resume.observe(value / 2)
        ours.migration_resume.observe(value / 2)

    def lines(registry: CollectorRegistry, *names: str) -> list[str]:
        text = generate_latest(registry).decode()
        kept = [ln for ln in text.splitlines() if ln.split("{")[0].split(" ")[0].startswith(names)]
        return [re.sub(r"(_created(\{.*\})?) .*", r"\1", ln) for ln in kept]

    names = (m.GATEWAY_TTFT.name, m.GATEWAY_MIGRATION_RESUME.name)
    got = lines(ours.registry, *names)
    assert got == lines(reference, *names)
    assert any(ln.endswith('le="+Inf"} 6.0') for ln in got)


def test_forgetting_an_engine_drops_its_pair_series():
    metrics = GatewayMetrics()
    metrics.kv_pair_open.labels("http://p", "http://e").set(1)
    metrics.kv_pair_open.labels("http://p", "http://other").set(1)
    metrics.peer_pull_bandwidth.labels("http://e", "http://h").set(1e9)
    metrics.forget_engine("http://e", "decode")
    open_pairs = {s.labels["decode"] for f in metrics.kv_pair_open.collect() for s in f.samples}
    assert open_pairs == {"http://other"}
    assert not [s for f in metrics.peer_pull_bandwidth.collect() for s in f.samples]
