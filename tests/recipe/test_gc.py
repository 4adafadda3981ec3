"""The codec's objects stay out of the cyclic garbage collector: a gateway keeps hundreds of converted requests
alive, and tracked ones would make every collection walk their messages."""

from __future__ import annotations

import gc

import pytest
from hypothesis import given
from hypothesis import strategies as st
from recipe_strategies import REQUESTS, examples

from recipe import APIS, RecipeError, convert


@pytest.mark.parametrize("api", APIS)
@given(data=st.data())
@examples(20)
def test_converted_requests_and_their_conversations_are_untracked(api: str, data: st.DataObject) -> None:
    try:
        converted = convert(api, data.draw(REQUESTS[api]()))
    except RecipeError:
        return
    conversation = converted.conversation
    structs = [converted, converted.sampling, converted.parsing, conversation, *conversation.messages,
               *conversation.tools]  # fmt: skip
    structs += [call for message in conversation.messages for call in getattr(message, "tool_calls", ())]
    assert not any(gc.is_tracked(struct) for struct in structs)
