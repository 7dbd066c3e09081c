"""Sampling fields are admissible or refused by name (engine/contracts/sampling_checks.py)."""

import pytest

from pdfleet.engine.contracts.sampling_checks import check_sampling


@pytest.mark.parametrize(
    ("body", "field"),
    [
        ({"stop_token_ids": [1000]}, "stop_token_ids"),
        ({"stop_token_ids": [2**70], "min_tokens": 2}, "stop_token_ids"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"top_k": 2**63, "temperature": 1}, "top_k"),
        ({"top_k": -2}, "top_k"),
        ({"top_k": True}, "top_k"),
        ({"n": 0}, "n"),
        ({"n": 10_000}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"seed": 2**64}, "seed"),
        ({"max_tokens": 5, "min_tokens": 10}, "min_tokens"),
        ({"max_completion_tokens": 5, "min_tokens": 10}, "min_tokens"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": 2**40}, "max_tokens"),
        ({"temperature": float("inf")}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"logprobs": 21}, "logprobs"),
        ({"logprobs": True, "top_logprobs": 50}, "top_logprobs"),
        ({"prompt": [1, 2, 5000]}, "prompt"),
        ({"prompt": [[1], [2, 999]]}, "prompt"),
        ({"logit_bias": {"5000": 1.0}}, "logit_bias"),
        ({"priority": 2**64}, "priority"),
    ],
)
def test_inadmissible_fields_are_refused_by_name(body, field):
    with pytest.raises(ValueError, match=field):
        check_sampling(body, vocab_size=999, max_logprobs=20)


def test_admissible_bodies_pass_and_bounds_follow_the_vocabulary():
    check_sampling(
        {
            "n": 2,
            "best_of": 3,
            "temperature": 0.7,
            "top_k": 0,
            "top_p": 1,
            "seed": -5,
            "max_tokens": 8,
            "min_tokens": 8,
            "stop_token_ids": [0, 998],
            "logprobs": True,
            "top_logprobs": 20,
            "prompt": [[0, 998]],
        },
        vocab_size=999,
        max_logprobs=20,
    )
    # Without a vocabulary (the gateway), ids are bounded by what a tensor holds.
    check_sampling({"stop_token_ids": [10_000]})
    with pytest.raises(ValueError, match="stop_token_ids"):
        check_sampling({"stop_token_ids": [2**40]})
