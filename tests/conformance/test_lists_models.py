"""The `lists_models` expectation: every answer is a model list naming each id with its
parent."""

from __future__ import annotations

import json

from conformance.client import Answer
from conformance.expect import check_answers
from conformance.model import Expect


def answer(data: object) -> Answer:
    return Answer(status=200, body=json.dumps(data).encode())


def test_a_list_naming_every_model_with_its_parent_holds() -> None:
    listing = {"data": [{"id": "m", "parent": None}, {"id": "x", "parent": "m"}, {"id": "z"}]}
    expect = Expect(lists_models={"m": None, "x": "m", "z": None})
    assert check_answers(expect, [answer(listing)]) == []


def test_a_missing_model_a_wrong_parent_or_no_list_fails() -> None:
    expect = Expect(lists_models={"x": "m", "y": "m"})
    good = answer({"data": [{"id": "x", "parent": "m"}, {"id": "y", "parent": "m"}]})
    [line] = check_answers(expect, [good, answer({"data": [{"id": "x", "parent": "n"}]})])
    assert line.startswith("lists_models: 1 of 2 answers fall short")
    assert "'x' has parent 'n', expected 'm'" in line and "'y' is not listed" in line
    [line] = check_answers(expect, [answer(["x"])])
    assert "not a model list" in line
