"""No request field is accepted and ignored: every field of the request models,
and every field of vLLM's completion, chat and tokenize requests, either works
or is refused by name; docs/serving.md lists each with the test proving it.

No server: these walk the models and the table (engine/contracts/request_fields.py).
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest

from pdfleet.engine.contracts import request_fields as rf
from pdfleet.engine.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)

ROOT = Path(__file__).resolve().parents[2]
MODELS = {
    rf.COMPLETIONS: CompletionRequest,
    rf.CHAT: ChatCompletionRequest,
    rf.TOKENIZE: TokenizeRequest,
    rf.DETOKENIZE: DetokenizeRequest,
}
# Values no refused field treats as a no-op (each refused field is refused for one).
SET_VALUES = (True, "x", 2, 0.5, [1], {"a": 1}, ["x", "y"])


@pytest.mark.parametrize("route", rf.ROUTES)
def test_every_model_field_works_on_its_route(route):
    """A field the model declares is served there (not dropped, not refused)."""
    model = MODELS[route]
    for name in model.model_fields:
        assert route in rf.WORKS.get(name, ()), f"{route}: {name} is declared but not in WORKS"


@pytest.mark.parametrize("route", rf.ROUTES)
def test_every_working_field_is_declared_by_the_model(route):
    """A field the table says works is read by the request model (the before-check
    lets it through; an undeclared one would be dropped silently)."""
    model = MODELS[route]
    for name, routes in rf.WORKS.items():
        if route in routes:
            assert name in model.model_fields, f"{route}: {name} works but the model lacks it"


@pytest.mark.parametrize("route", rf.ROUTES)
def test_every_vllm_field_works_or_is_refused(route):
    for name in rf.VLLM_FIELDS[route]:
        works = route in rf.WORKS.get(name, ())
        refused = name in rf.REFUSED
        assert works or refused, f"{route}: vLLM's {name} is in neither table"
        assert not (works and refused), f"{route}: {name} is in both tables"


@pytest.mark.parametrize("name", sorted(rf.REFUSED))
def test_a_refused_field_is_a_400_naming_it(name):
    """Set to something, a refused field is refused by name; at its no-op value
    (null) it passes."""
    refused = 0
    for value in SET_VALUES:
        body = {"prompt": "x", name: value}
        if rf.refused_reason(name, value, body) is None:
            continue
        with pytest.raises(ValueError, match=rf"^{name} is not supported by pdfleet"):
            rf.check_fields(body, rf.COMPLETIONS)
        with pytest.raises(APIError) as e:
            ChatCompletionRequest.model_validate(
                {"messages": [{"role": "user", "content": "x"}], name: value}
            )
        assert e.value.status == 400 and e.value.param == name
        refused += 1
    assert refused, f"{name} is refused for none of {SET_VALUES}"
    rf.check_fields({"prompt": "x", name: None}, rf.COMPLETIONS)


@pytest.mark.parametrize("name", ["functions", "logprob_token_ids", "bad_words", "suffix"])
def test_an_empty_value_of_a_refused_field_is_a_no_op(name):
    """An empty list (or string) asks for nothing: it passes, on both routes'
    models, as null does; a non-empty value is still refused by name."""
    empty: Any = "" if name == "suffix" else []
    rf.check_fields({"prompt": "x", name: empty}, rf.COMPLETIONS)
    ChatCompletionRequest.model_validate(
        {"messages": [{"role": "user", "content": "x"}], name: empty}
    )
    with pytest.raises(ValueError, match=rf"^{name} is not supported by pdfleet"):
        rf.check_fields({"prompt": "x", name: "x" if name == "suffix" else [1]}, rf.COMPLETIONS)
    with pytest.raises(ValueError, match=r"^allowed_token_ids is not supported"):
        rf.check_fields({"prompt": "x", "allowed_token_ids": []}, rf.COMPLETIONS)


def test_unknown_fields_and_fields_of_another_route_are_refused_by_name():
    with pytest.raises(ValueError, match=r"^frobnicate is not a field of this request"):
        rf.check_fields({"prompt": "x", "frobnicate": 1}, rf.COMPLETIONS)
    with pytest.raises(ValueError, match=r"^tools is not a field of this request.*chat"):
        rf.check_fields({"prompt": "x", "tools": []}, rf.COMPLETIONS)
    with pytest.raises(ValueError, match=r"^messages"):
        rf.check_fields({"prompt": "x", "messages": []}, rf.COMPLETIONS)


def _doc_rows() -> dict[str, tuple[str, str]]:
    """docs/serving.md's field table: field -> (status, proving test)."""
    text = (ROOT / "docs" / "serving.md").read_text()
    start = text.index("## Request fields")
    rows = {}
    for line in text[start:].splitlines():
        m = re.match(r"\|\s*`([a-z_]+)`\s*\|\s*(works|refused)\s*\|[^|]*\|\s*`([^`]+)`\s*\|", line)
        if m:
            rows[m.group(1)] = (m.group(2), m.group(3))
    return rows


def _conformance_tests() -> set[str]:
    names = set()
    for path in (ROOT / "tests" / "conformance").glob("test_*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                names.add(f"{path.name}::{node.name}")
    return names


def test_docs_table_lists_every_field_with_a_test_that_exists():
    rows = _doc_rows()
    tests = _conformance_tests()
    every = set(rf.WORKS) | set(rf.REFUSED)
    assert set(rows) == every, (
        f"missing from docs: {sorted(every - set(rows))}; extra: {sorted(set(rows) - every)}"
    )
    for name, (status, test) in rows.items():
        assert status == ("refused" if name in rf.REFUSED else "works"), name
        assert test in tests, f"{name}: docs name {test}, which does not exist"


def test_logprob_counts_take_minus_one_within_max_logprobs():
    """-1 asks for the whole vocabulary: allowed where max_logprobs allows that
    many (-1: no bound), else a 400 naming the field and the bound; the gateway
    (no bound known) leaves it to the engine."""
    from pdfleet.engine.contracts.sampling_checks import check_sampling

    for body in ({"logprobs": -1}, {"prompt_logprobs": -1}, {"logprobs": True, "top_logprobs": -1}):
        check_sampling(body, vocab_size=1000, max_logprobs=-1)
        check_sampling(body, vocab_size=1000, max_logprobs=1000)
        check_sampling(body)  # the gateway's check
        name = "top_logprobs" if "top_logprobs" in body else next(iter(body))
        with pytest.raises(ValueError, match=rf"^{name}: -1 .*1000 tokens.*max_logprobs \(20\)"):
            check_sampling(body, vocab_size=1000, max_logprobs=20)
    with pytest.raises(ValueError, match=r"^logprobs must be -1 or an integer 0\.\.20"):
        check_sampling({"logprobs": -2}, vocab_size=1000, max_logprobs=20)


def test_migration_is_an_internal_resume_state():
    """``migration`` (a decode leg the gateway resumes, docs/migration.md) is a
    field of both generation routes, shaped strictly, for one sequence only;
    that only the fleet token may send it is tests/gateway/test_migration.py's
    and tests/security/test_kv_content.py's."""
    from pdfleet.engine.entrypoints.openai.protocol import (
        APIError,
        ChatCompletionRequest,
        CompletionRequest,
    )

    for route in (rf.CHAT, rf.COMPLETIONS):
        rf.check_fields({"migration": {"output_token_ids": [1]}}, route)
    req = CompletionRequest.model_validate(
        {"prompt": "x", "migration": {"output_token_ids": [3, 4], "created": 7}}
    )
    params = req.sampling_params({}, 16, None)
    assert params.resumed_token_ids == [3, 4]
    with pytest.raises(APIError, match="^migration.bogus: unknown field") as refused:
        ChatCompletionRequest.model_validate(
            {"messages": [{"role": "user", "content": "x"}], "migration": {"bogus": 1}}
        )
    assert refused.value.param == "migration.bogus"
    # A request of several choices migrates too, naming its sent tokens per
    # choice (on a stream: a non-streamed one goes again whole).
    assert (
        CompletionRequest.model_validate({"prompt": "x", "n": 2, "migration": {}})
        .sampling_params({}, 16, None)
        .n
        == 2
    )
    with pytest.raises(APIError, match="^migration.output_token_ids: "):
        CompletionRequest.model_validate(
            {"prompt": "x", "n": 2, "migration": {"output_token_ids": [1]}}
        ).sampling_params({}, 16, None)
    with pytest.raises(APIError, match="^migration.choices: only a stream"):
        CompletionRequest.model_validate(
            {"prompt": "x", "n": 2, "migration": {"choices": [[1], None]}}
        ).sampling_params({}, 16, None)
    with pytest.raises(APIError, match="^migration.output_token_ids: 2 tokens already sent") as e:
        CompletionRequest.model_validate(
            {"prompt": "x", "migration": {"output_token_ids": [1, 2]}}
        ).sampling_params({}, 2, None)
    assert e.value.param == "migration.output_token_ids"
