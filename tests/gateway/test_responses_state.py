"""The stateful Responses API through the real `openai` SDK against a real gateway over a real cache, prefill and
decode (the tiny model, in this process): stored responses continued by `previous_response_id` across a gateway
restart as a prefix hit, retrieve / delete / input items, `store: false`, `/v1/responses/compact`, and the
WebSocket mode (the SDK's `responses.connect()`). Every object is validated against the vendored Open Responses
schema."""

from __future__ import annotations

import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from gateway_helpers import API_KEY, InProcessGateway

from gateway.config import GatewayConfig
from tests.open_responses.schema import check, check_event

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "prefill_svc"))
from service_mesh import Loop, Mesh, tiny_models  # the service tests' in-process cache, prefill and decode

MODEL = "DeepSeek-V4.1-Flash"
OPENING = "Remember these words, then answer in one word: " + " ".join(f"word{i}" for i in range(60))
TURN = {"model": MODEL, "max_output_tokens": 4, "reasoning": {"effort": "none"}, "temperature": 0}


@pytest.fixture(scope="module")
def mesh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mesh]:
    loop = Loop()
    served = Mesh(loop, tmp_path_factory.mktemp("cache"), tiny_models())
    yield served
    served.stop()
    loop.close()


@pytest.fixture(scope="module")
def start(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Callable[..., InProcessGateway]]:
    """`start()` → a gateway over the mesh keeping responses in the module's store file (stopped at the end)."""
    store = tmp_path_factory.mktemp("responses") / "responses.sqlite3"
    started: list[InProcessGateway] = []

    def run(**options: Any) -> InProcessGateway:
        options = {"compact_max_tokens": 8, **options}  # random weights never stop: a summary of 8 tokens
        cfg = GatewayConfig(
            port=0, grpc_port=0, prefill=[f"127.0.0.1:{mesh.prefill.port}"], decode=[f"127.0.0.1:{mesh.decode.port}"],
            cache=mesh.cache_addresses, api_key=API_KEY, response_store=str(store), **options,
        )  # fmt: skip
        started.append(InProcessGateway(cfg))
        return started[-1]

    yield run
    for gateway in started:
        if gateway.loop.is_running():
            gateway.stop()


@pytest.fixture(scope="module")
def gateway(start: Callable[..., InProcessGateway]) -> InProcessGateway:
    return start()


def client(gateway: InProcessGateway) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def created(oai: openai.OpenAI, **fields: Any) -> Any:
    """A complete response, validated against the schema."""
    response = oai.responses.create(**{**TURN, **fields})
    check("ResponseResource", response.model_dump(mode="json", exclude_unset=True))
    return response


def test_a_stored_conversation_continues_across_a_gateway_restart_from_the_cache(
    start: Callable[..., InProcessGateway], mesh: Mesh, gateway: InProcessGateway
) -> None:
    first_gateway = start()
    first = created(client(first_gateway), input=OPENING, extra_body={"cache_salt": "restart"})
    assert first.store is True
    first_gateway.stop()

    oai = client(start())  # a new process's gateway: only the store file is shared
    second = created(oai, input="And again?", previous_response_id=first.id)
    assert second.previous_response_id == first.id
    # The new turn's prompt opens with the first turn's whole prompt: at least its full blocks came from the cache.
    full_blocks = first.usage.input_tokens // mesh.block_tokens * mesh.block_tokens
    assert full_blocks > 0
    assert second.usage.input_tokens_details.cached_tokens >= full_blocks
    assert second.usage.input_tokens > first.usage.input_tokens + first.usage.output_tokens

    assert oai.responses.retrieve(first.id).model_dump() == first.model_dump()
    items = oai.responses.input_items.list(second.id)
    assert [item.content[0].text for item in items.data] == ["And again?"]  # its own input, not the chain's
    # Another gateway running over the same store file sees it at once.
    assert client(gateway).responses.retrieve(second.id).model_dump() == second.model_dump()


def test_retrieve_delete_and_input_items_answer_in_the_api_shape(gateway: InProcessGateway) -> None:
    oai = client(gateway)
    messages = [{"role": "user", "content": f"message {i}"} for i in range(3)]
    response = created(oai, input=messages)
    listed = oai.responses.input_items.list(response.id, order="asc", limit=2)
    assert [item.content[0].text for item in listed.data] == ["message 0", "message 1"]
    every = [item.content[0].text for item in oai.responses.input_items.list(response.id, order="asc")]
    assert every == ["message 0", "message 1", "message 2"]  # the SDK follows `has_more` with `after`

    deleted = oai.responses.delete(response.id)
    assert deleted is None  # the SDK returns nothing for a 200
    for call in (oai.responses.retrieve, oai.responses.delete, oai.responses.input_items.list):
        with pytest.raises(openai.NotFoundError) as missing:
            call(response.id)
        assert missing.value.body["message"] == f"Response with id '{response.id}' not found."  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as gone:
        created(oai, input="more", previous_response_id=response.id)
    assert gone.value.code == "previous_response_not_found"
    assert gone.value.param == "previous_response_id"
    bad_query = httpx.get(f"{gateway.base_url}/v1/responses/x/input_items?limit=0",
                          headers={"authorization": f"Bearer {API_KEY}"})  # fmt: skip
    assert bad_query.status_code in (400, 404)


def test_store_false_keeps_nothing_and_a_stream_is_stored_before_it_ends(gateway: InProcessGateway) -> None:
    oai = client(gateway)
    unstored = created(oai, input="Say hi.", store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        oai.responses.retrieve(unstored.id)
    with pytest.raises(openai.BadRequestError) as missing:
        created(oai, input="more", previous_response_id=unstored.id)
    assert missing.value.code == "previous_response_not_found"

    events = list(oai.responses.create(**TURN, input="Stream a word.", stream=True))
    for event in events:
        check_event(event.model_dump(mode="json", exclude_unset=True))
    final = events[-1].response  # type: ignore[union-attr]
    assert oai.responses.retrieve(final.id).model_dump() == final.model_dump()  # kept before the last event left


def test_compact_summarises_into_an_item_that_starts_a_new_chain(gateway: InProcessGateway) -> None:
    oai = client(gateway)
    first = created(oai, input="We launch on Tuesday and notify support first.")
    compacted = oai.responses.compact(model=MODEL, previous_response_id=first.id,
                                      input=[{"role": "user", "content": "Anything else?"}])  # fmt: skip
    body = compacted.model_dump(mode="json", exclude_unset=True, warnings=False)
    check("CompactResource", body)
    assert body["object"] == "response.compaction"
    assert body["usage"]["output_tokens"] <= 8  # the summary's budget: --compact-max-tokens
    assert [item["type"] for item in body["output"]] == ["message", "message", "compaction"]
    assert [item["content"][0]["text"] for item in body["output"][:2]] == [
        "We launch on Tuesday and notify support first.",
        "Anything else?",
    ]
    follow_up = created(oai, input=[*body["output"], {"role": "user", "content": "When do we launch?"}])
    assert follow_up.previous_response_id is None
    assert follow_up.status in ("completed", "incomplete")

    headers = {"authorization": f"Bearer {API_KEY}"}
    no_model = httpx.post(f"{gateway.base_url}/v1/responses/compact", json={"input": "x"}, headers=headers)
    assert no_model.status_code == 400
    assert no_model.json()["error"]["param"] == "model"
    unknown = httpx.post(f"{gateway.base_url}/v1/responses/compact", headers=headers,
                         json={"model": MODEL, "previous_response_id": "resp_unknown"})  # fmt: skip
    assert unknown.status_code == 400
    assert unknown.json()["error"]["code"] == "previous_response_not_found"
    forged = created_error(oai, input=[{"type": "compaction", "encrypted_content": "gAAAA-not-ours"}])
    assert forged.param == "input[0].encrypted_content"


def created_error(oai: openai.OpenAI, **fields: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as refused:
        oai.responses.create(**{**TURN, **fields})
    return refused.value


def socket_turn(connection: Any, **fields: Any) -> list[dict[str, Any]]:
    """Send one `response.create` and read its events up to the terminal one (or an error), each validated."""
    connection.send({"type": "response.create", **TURN, **fields})
    events = []
    for event in connection:
        body = event.model_dump(mode="json", exclude_unset=True)
        if body["type"] == "error":
            check("WebSocketErrorEvent", body)
        else:
            check_event(body)
        events.append(body)
        if body["type"] in ("error", "response.completed", "response.incomplete", "response.failed"):
            return events
    raise AssertionError("the connection closed mid-turn")


def test_websocket_continues_in_connection_memory_and_recovers_after_reconnect(gateway: InProcessGateway) -> None:
    oai = client(gateway)
    with oai.responses.connect() as connection:
        first = socket_turn(connection, input=OPENING, store=False)[-1]["response"]
        second = socket_turn(connection, input="And again?", store=False, previous_response_id=first["id"])[-1]
        assert second["type"] in ("response.completed", "response.incomplete")
        assert second["response"]["previous_response_id"] == first["id"]
        assert second["response"]["usage"]["input_tokens_details"]["cached_tokens"] > 0
        with pytest.raises(openai.NotFoundError):  # store: false: never written to the store
            oai.responses.retrieve(first["id"])

        # A continuation that fails forgets the turn it named.
        latest = second["response"]["id"]
        failed = socket_turn(connection, input="x", store=False, previous_response_id=latest, temperature=5)
        assert failed[-1]["status"] == 400
        again = socket_turn(connection, input="x", store=False, previous_response_id=latest)
        assert again[-1]["error"]["code"] == "previous_response_not_found"

    with oai.responses.connect() as reconnected:  # a new connection has no memory of a store: false turn
        lost = socket_turn(reconnected, input="more", store=False, previous_response_id=latest)
        assert lost[-1]["error"]["code"] == "previous_response_not_found"
        assert lost[-1]["status"] == 400
        recovered = socket_turn(reconnected, input=[{"role": "user", "content": OPENING}], store=False)
        assert recovered[-1]["type"] in ("response.completed", "response.incomplete")
        stored = socket_turn(reconnected, input="Stored.")[-1]["response"]

    with oai.responses.connect() as later:  # a stored turn continues on any connection
        continued = socket_turn(later, input="Go on.", previous_response_id=stored["id"])[-1]
        assert continued["response"]["previous_response_id"] == stored["id"]
        refused = socket_turn(later, input="x", stream=True)
        assert (refused[-1]["status"], refused[-1]["error"]["param"]) == (400, "stream")


def test_websocket_has_the_http_auth_and_time_limit(start: Callable[..., InProcessGateway]) -> None:
    gateway = start(websocket_max_s=0.5)
    wrong = openai.OpenAI(base_url=gateway.base_url + "/v1", api_key="wrong", max_retries=0)
    with wrong.responses.connect(max_retries=0) as connection:
        event = connection.recv().model_dump(mode="json", exclude_unset=True)
    assert (event["type"], event["status"]) == ("error", 401)
    with client(gateway).responses.connect(max_retries=0) as connection:
        event = connection.recv().model_dump(mode="json", exclude_unset=True)  # nothing sent: the limit ends it
    assert event["error"]["code"] == "websocket_connection_limit_reached"
    gateway.stop()
