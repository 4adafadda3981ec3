"""Failure handling end to end: each case kills (or freezes, then kills) a real process of the mesh and checks what
the client sees, then the process is restarted for the next test.

- a prefill or decode replica dies while a request waits on it → the request is retried on the other replica;
- every prefill replica is down → decode prefills the prompt itself (served without reuse, counted);
- every decode replica is down → 503 with a clear message in the API's error shape, and the handoff record prefill
  wrote for the request expires with its lease;
- the decode replicas die mid-stream → each API's stream ends with its own error event, nothing hangs;
- the cache dies → requests are still served, without reuse; once it is back its blocks are reused, and the SWA
  records it lost are rebuilt by bounded replay (counted);
- the client disconnects → the decode sequence is aborted and its slot freed;
- the admission queue is full → 429 with Retry-After, in each API's error shape;
- the gateway gets SIGTERM → it stops taking requests at once, the stream in flight runs to its end, exit 0.
"""

from __future__ import annotations

import json
import signal
import socket
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import anthropic
import httpx
import openai
import pytest
from e2e_helpers import MODEL, decode_load, killed, metric, model_info, signal_child, start_gateway, wait_for

from cache_svc.client import CacheClient
from gateway import rendezvous
from gateway.affinity import AffinityKey
from mesh.processes import Mesh, http_ready

NO_THINKING = {"thinking": {"type": "disabled"}}
STREAM_TIMEOUT_S = 120.0


def ask(text: str) -> list[dict]:
    return [{"role": "user", "content": text}]


def chat(oai: openai.OpenAI, text: str, max_tokens: int = 4, **extra: Any) -> Any:
    return oai.chat.completions.create(
        model=MODEL, messages=ask(text), max_tokens=max_tokens, extra_body=NO_THINKING, **extra
    )


@pytest.fixture(scope="module")
def unpolled_gateway(mesh: Mesh, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A gateway that polls replica loads once, at start: a replica frozen later still gets its share of requests
    (the main gateway would notice within a second and route around it before the test could route to it)."""
    url, process = start_gateway(
        mesh, tmp_path_factory.mktemp("unpolled") / "gateway.log", "--load-interval-s", "3600", "--inhibit-s", "0"
    )
    yield url
    process.terminate()
    process.wait(30)


def sessions_owned_by(mesh: Mesh, role: str) -> list[str]:
    """Two session ids, the first owned by `role`-0 and the second by the other replica: a conversation this gateway
    never saw goes to its rendezvous owner among the replicas (named by their addresses, random ports here)."""
    names = [c.address for c in mesh.children if c.name.startswith(role)]
    frozen = mesh.child(f"{role}-0").address
    owners = {f"s{i}": rendezvous.owner(AffinityKey(session=f"s{i}").conversation or b"", names) for i in range(64)}
    return [next(s for s, o in owners.items() if o == frozen), next(s for s, o in owners.items() if o != frozen)]


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_a_replica_that_dies_under_a_request_is_retried_elsewhere(mesh: Mesh, unpolled_gateway: str, role: str) -> None:
    client = openai.OpenAI(base_url=unpolled_gateway + "/v1", api_key="k", max_retries=0, timeout=STREAM_TIMEOUT_S)
    retries = metric(unpolled_gateway, "v41mesh_gateway_retries_total", role=role)
    with killed(mesh, f"{role}-0"), ThreadPoolExecutor(2) as pool:
        signal_child(mesh, f"{role}-0", signal.SIGSTOP)  # frozen: the request routed to it waits
        futures = [  # one conversation owned by each replica
            pool.submit(chat, client, f"question {i}", extra_headers={"x-session-id": session})
            for i, session in enumerate(sessions_owned_by(mesh, role))
        ]
        wait_for(lambda: sum(f.done() for f in futures) >= 1, "the request on the live replica")
        assert sum(f.done() for f in futures) == 1, f"both requests avoided the frozen {role}-0"
        signal_child(mesh, f"{role}-0", signal.SIGKILL)
        results = [f.result(timeout=STREAM_TIMEOUT_S) for f in futures]
    assert all(r.choices[0].finish_reason == "length" for r in results)
    assert metric(unpolled_gateway, "v41mesh_gateway_retries_total", role=role) > retries


def test_without_prefill_decode_prefills_itself(mesh: Mesh, oai: openai.OpenAI) -> None:
    fallbacks = metric(mesh.base_url, "v41mesh_gateway_fallbacks_total")
    with killed(mesh, "prefill-0", "prefill-1"):
        for name in ("prefill-0", "prefill-1"):
            signal_child(mesh, name, signal.SIGKILL)
        response = chat(oai, "served without prefill " * 8)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert metric(mesh.base_url, "v41mesh_gateway_fallbacks_total") > fallbacks


def test_a_gateway_whose_prefill_is_down_from_its_start_serves_through_decode(mesh: Mesh, tmp_path: Any) -> None:
    """No prefill replica ever answered this gateway: it learns the model from a decode replica's GetModelInfo,
    becomes ready, and serves every request by decode's own prefill, each counted as a fallback (n choices: n)."""
    with socket.socket() as held:  # bound, never listening: refused, and no other test's server can take the port
        held.bind(("127.0.0.1", 0))
        _served_through_decode(mesh, tmp_path, f"127.0.0.1:{held.getsockname()[1]}")


def _served_through_decode(mesh: Mesh, tmp_path: Any, nowhere: str) -> None:
    url, process = start_gateway(mesh, tmp_path / "gateway.log", prefill=nowhere)
    try:
        health = httpx.get(url + "/health", timeout=10).json()
        assert health["ready"] is True
        assert health["replicas_up"]["prefill"] == 0
        client = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0, timeout=STREAM_TIMEOUT_S)
        response = chat(client, "served with every prefill replica down " * 6)
        choices = chat(client, "two choices with every prefill replica down", n=2)
        message = anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
            model=MODEL, max_tokens=4, messages=ask("and through the Messages API")
        )
        fallbacks = metric(url, "v41mesh_gateway_fallbacks_total", reason="prefill_unavailable")
    finally:
        process.terminate()
        process.wait(30)
    assert response.choices[0].finish_reason == "length"
    assert response.usage.completion_tokens == 4
    assert response.usage.prompt_tokens_details.cached_tokens == 0
    assert message.stop_reason == "max_tokens"
    assert [(c.index, c.finish_reason) for c in choices.choices] == [(0, "length"), (1, "length")]
    assert choices.usage.completion_tokens == 2 * 4
    assert fallbacks == 1 + 1 + 2  # each choice's decode prefilled the prompt itself


def test_without_decode_503_in_the_apis_shape_and_the_unclaimed_handoff_expires(
    mesh: Mesh, oai: openai.OpenAI, claude: anthropic.Anthropic, extra_gateway: Callable[..., str]
) -> None:
    short_lease = extra_gateway("--handoff-lease-s", "1")
    with CacheClient(mesh.child("cache").address) as cache:
        expiries = cache.stats()[mesh.child("cache").address]["record_expiries"]
        with killed(mesh, "decode-0", "decode-1"):
            for name in ("decode-0", "decode-1"):
                signal_child(mesh, name, signal.SIGKILL)
            with pytest.raises(openai.InternalServerError) as chat_error:
                chat(oai, "anyone there?")
            with pytest.raises(anthropic.APIStatusError) as messages_error:
                claude.messages.create(model=MODEL, max_tokens=4, messages=ask("anyone there?"))
            # Prefill wrote a handoff record for it; no decode will ever take it: its lease ends it.
            with pytest.raises(openai.InternalServerError):
                openai.OpenAI(base_url=short_lease + "/v1", api_key="k", max_retries=0).chat.completions.create(
                    model=MODEL, messages=ask("a handoff nobody takes"), max_tokens=4
                )
            stats = cache.stats
            address = mesh.child("cache").address
            wait_for(lambda: stats()[address]["record_expiries"] > expiries, "the unclaimed handoff's lease to end")
    assert chat_error.value.status_code == 503
    assert "No decode replica could serve the request" in chat_error.value.message
    assert messages_error.value.status_code == 503
    assert messages_error.value.body["type"] == "error"
    assert "No decode replica" in messages_error.value.body["error"]["message"]


def _consume(started: threading.Event, events: Callable[[], Any]) -> tuple[list[Any], BaseException | None]:
    """Read a stream to its end, setting `started` at its first event; returns (events, the exception it raised)."""
    seen: list[Any] = []
    try:
        for event in events():
            seen.append(event)
            started.set()
    except (openai.APIError, anthropic.APIError) as exc:
        return seen, exc
    return seen, None


def test_decode_dying_mid_stream_ends_each_api_with_its_error_event(
    mesh: Mesh, oai: openai.OpenAI, claude: anthropic.Anthropic
) -> None:
    streams: dict[str, Callable[[], Any]] = {
        "chat": lambda: oai.chat.completions.create(
            model=MODEL, messages=ask("a long story"), max_tokens=3000, stream=True, extra_body=NO_THINKING
        ),
        "responses": lambda: oai.responses.create(
            model=MODEL, input="a long story", max_output_tokens=3000, stream=True, reasoning={"effort": "none"}
        ),
        "messages": lambda: claude.messages.create(
            model=MODEL, max_tokens=3000, messages=ask("a long story"), stream=True, thinking={"type": "disabled"}
        ),
    }
    started = {name: threading.Event() for name in streams}
    with killed(mesh, "decode-0", "decode-1"), ThreadPoolExecutor(len(streams)) as pool:
        futures: dict[str, Future[tuple[list[Any], BaseException | None]]] = {
            name: pool.submit(_consume, started[name], events) for name, events in streams.items()
        }
        wait_for(lambda: all(e.is_set() for e in started.values()), "all three streams to start")
        for name in ("decode-0", "decode-1"):
            signal_child(mesh, name, signal.SIGKILL)
        outcome = {name: future.result(timeout=STREAM_TIMEOUT_S) for name, future in futures.items()}
    _chat_events, chat_error = outcome["chat"]
    assert isinstance(chat_error, openai.APIError)
    assert "failed mid-generation" in chat_error.message
    responses_events, responses_error = outcome["responses"]
    assert responses_error is None
    assert responses_events[-1].type == "response.failed"
    assert "failed mid-generation" in responses_events[-1].response.error.message
    _, messages_error = outcome["messages"]
    assert isinstance(messages_error, anthropic.APIError)
    assert "failed mid-generation" in str(messages_error)


def test_cache_loss_serves_without_reuse_then_replays_what_it_lost(mesh: Mesh, oai: openai.OpenAI) -> None:
    history = ask("A conversation long enough to fill several cache blocks. " * 12)
    first = oai.chat.completions.create(model=MODEL, messages=history, max_tokens=4, extra_body=NO_THINKING)
    turn = [*history, {"role": "assistant", "content": first.choices[0].message.content}, *ask("And then?")]
    fallbacks = metric(mesh.base_url, "v41mesh_gateway_fallbacks_total")
    with killed(mesh, "cache"):
        signal_child(mesh, "cache", signal.SIGKILL)
        blind = oai.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, extra_body=NO_THINKING)
        assert blind.choices[0].finish_reason == "length"
        assert blind.usage.prompt_tokens_details.cached_tokens == 0
        assert metric(mesh.base_url, "v41mesh_gateway_fallbacks_total") > fallbacks
    replays = metric(mesh.base_url, "v41mesh_gateway_bounded_replays_total")
    found: list[Any] = []

    def reused() -> bool:  # the prefill replicas retry the cache a moment after it failed them
        found[:] = [oai.chat.completions.create(model=MODEL, messages=turn, max_tokens=4, extra_body=NO_THINKING)]
        return found[0].usage.prompt_tokens_details.cached_tokens > 0

    wait_for(reused, "the restarted cache to serve the blocks it kept on disk")
    block = model_info(mesh.child("prefill-0").address).kv_block_tokens
    assert found[0].usage.prompt_tokens_details.cached_tokens >= first.usage.prompt_tokens // block * block
    assert metric(mesh.base_url, "v41mesh_gateway_bounded_replays_total") > replays  # SWA records died with it


def test_client_disconnect_aborts_the_decode_sequence(mesh: Mesh) -> None:
    cancellations = metric(mesh.base_url, "v41mesh_gateway_cancellations_total", reason="client_disconnect")
    body = {"model": MODEL, "messages": ask("go on forever"), "max_tokens": 3000, "stream": True, **NO_THINKING}
    with (
        httpx.Client(timeout=STREAM_TIMEOUT_S) as client,
        client.stream("POST", mesh.base_url + "/v1/chat/completions", json=body) as response,
    ):
        assert response.status_code == 200
        for n, _ in enumerate(response.iter_lines()):
            if n == 6:
                break
    decodes = [c.address for c in mesh.children if c.name.startswith("decode")]
    wait_for(lambda: all(decode_load(a).running == 0 for a in decodes), "decode to free the sequence")
    after = metric(mesh.base_url, "v41mesh_gateway_cancellations_total", reason="client_disconnect")
    assert after == cancellations + 1


def test_a_full_queue_is_429_with_retry_after(mesh: Mesh, extra_gateway: Callable[..., str]) -> None:
    url = extra_gateway("--max-inflight", "1", "--max-queue", "0")
    body = {"model": MODEL, "messages": ask("hold the only slot"), "max_tokens": 3000, "stream": True, **NO_THINKING}
    with (
        httpx.Client(timeout=STREAM_TIMEOUT_S) as client,
        client.stream("POST", url + "/v1/chat/completions", json=body) as holder,
    ):
        assert holder.status_code == 200
        lines = holder.iter_lines()
        assert next(lines).startswith("data: ")  # streaming: the slot is taken until the stream ends
        assert httpx.get(url + "/health").json()["inflight"] == 1
        try:
            openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0).chat.completions.create(
                model=MODEL, messages=ask("me too"), max_tokens=2
            )
        except openai.RateLimitError as refused:
            chat_refused = refused
        else:
            pytest.fail(f"admitted while the only slot was held; the holder's stream ended with {list(lines)[-3:]}")
        with pytest.raises(anthropic.RateLimitError) as messages_refused:
            anthropic.Anthropic(base_url=url, api_key="k", max_retries=0).messages.create(
                model=MODEL, max_tokens=2, messages=ask("me too")
            )
    assert int(chat_refused.response.headers["retry-after"]) >= 1
    assert chat_refused.body["type"] == "invalid_request_error"
    assert messages_refused.value.body["error"]["type"] == "rate_limit_error"
    assert "overloaded" in messages_refused.value.body["error"]["message"]
    assert metric(url, "v41mesh_gateway_errors_total", kind="overloaded") == 2
    assert metric(url, "v41mesh_gateway_admission_refusals_total", reason="queue_full") == 2


def test_sigterm_drains_the_gateway(mesh: Mesh, tmp_path: Any) -> None:
    url, process = start_gateway(mesh, tmp_path / "gateway.log")
    body = {"model": MODEL, "messages": ask("finish me"), "max_tokens": 12, "stream": True, **NO_THINKING}
    try:
        with (
            httpx.Client(timeout=STREAM_TIMEOUT_S) as client,
            client.stream("POST", url + "/v1/chat/completions", json=body) as stream,
        ):
            lines = stream.iter_lines()
            assert next(lines).startswith("data: ")
            process.send_signal(signal.SIGTERM)
            wait_for(lambda: not http_ready(url), "the gateway to stop taking new requests")
            rest = [line for line in lines if line]
        assert rest[-1] == "data: [DONE]"  # the stream in flight ran to its end
        assert json.loads(rest[-2][len("data: ") :])["choices"][0]["finish_reason"] == "length"
        assert process.wait(STREAM_TIMEOUT_S) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
