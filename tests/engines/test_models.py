"""An engine's model list: base models and the LoRA adapters it names with a parent."""

from __future__ import annotations

import pytest

from router.engines.models import parse_model_list


def test_vllm_lists_adapters_with_their_parent_after_the_base_model() -> None:
    body = {
        "object": "list",
        "data": [
            {"id": "tiny", "parent": None, "root": "/models/tiny"},
            {"id": "a", "parent": "tiny", "root": "/adapters/a"},
            {"id": "b", "parent": "tiny"},
        ],
    }
    listing = parse_model_list(body)
    assert listing.models == ("tiny",)
    assert listing.adapters == {"a": "tiny", "b": "tiny"}


def test_a_list_without_parents_names_models_only_and_odd_entries_are_skipped() -> None:
    body = {"data": [{"id": "m"}, {"id": ""}, "x", {"id": 3}, {"id": "self", "parent": "self"}]}
    listing = parse_model_list(body)
    assert listing.models == ("m", "self")
    assert listing.adapters == {}


@pytest.mark.parametrize("body", [None, [], {"data": {}}, {"object": "list"}])
def test_an_answer_that_is_no_model_list_is_refused(body: object) -> None:
    with pytest.raises(ValueError, match="model list"):
        parse_model_list(body)
