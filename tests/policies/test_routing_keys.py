"""The routing text: the whole prompt, rendered so that a growing conversation keeps its prefix."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from router.policies.routing_keys import routing_text


def test_chat_renders_every_message_with_its_role() -> None:
    body = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": "Look: "},
                    {"type": "image_url", "image_url": {"url": "x"}},
                    {"type": "text", "text": "a cat"},
                ],
            },
            {"role": "assistant", "content": None},
        ]
    }
    assert routing_text(body) == "system\nBe brief.\nuser\nLook: a cat\nassistant\n\n"


def test_chat_routes_on_every_message_not_only_the_first() -> None:
    first = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "one"}]}
    second = {"messages": [{"role": "system", "content": "S"}, {"role": "user", "content": "two"}]}
    assert routing_text(first) != routing_text(second)


messages = st.lists(
    st.fixed_dictionaries(
        {"role": st.sampled_from(["system", "user", "assistant"]), "content": st.text(max_size=20)}
    ),
    min_size=1,
    max_size=6,
)


@given(messages, messages)
def test_a_conversation_that_grows_keeps_its_earlier_text_as_a_prefix(
    earlier: list[dict[str, str]], later: list[dict[str, str]]
) -> None:
    assert routing_text({"messages": earlier + later}).startswith(
        routing_text({"messages": earlier})
    )


def test_completions_and_generate() -> None:
    assert routing_text({"prompt": "hello"}) == "hello"
    assert routing_text({"prompt": ["a", "b"]}) == "a\nb"
    assert routing_text({"prompt": [1, 2, 3]}) == "1,2,3,"
    assert routing_text({"prompt": [[1, 2], [3]]}) == "1,2,\n3,"
    assert routing_text({"text": "hi"}) == "hi"
    assert routing_text({"input_ids": [12, 3]}) == "12,3,"
    # "1,2," is no prefix of "1,23,": a different token never looks like a shared one.
    assert not routing_text({"input_ids": [1, 23]}).startswith(routing_text({"input_ids": [1, 2]}))


def test_anything_unexpected_renders_empty() -> None:
    assert routing_text({}) == ""
    assert routing_text({"prompt": []}) == ""
    assert routing_text({"prompt": [True, 2]}) == ""
    assert routing_text({"messages": ["not a message"]}) == ""
