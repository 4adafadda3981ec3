"""Conversations across gateway replicas: two gateways with empty affinity tables, in front of the same three decode
replicas (real ones, the tiny model, on loopback), send every turn of a conversation to the same replica whichever of
them serves the turn: its rendezvous owner, named by its session header or by its opening (the messages up to its
first user message). Gateways that no longer see one replica move only the conversations that replica owned."""

from __future__ import annotations

import collections
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from decode_replicas import WAIT_S, Decodes, wait_until
from gateway_helpers import InProcessGateway, refusing_address

from gateway.config import GatewayConfig

MODEL = "DeepSeek-V4.1-Flash"


@pytest.fixture(scope="module")
def decodes() -> Iterator[Decodes]:
    replicas = Decodes(3)
    yield replicas
    replicas.stop()


@contextmanager
def gateways(decode: list[str], count: int = 2) -> Iterator[list[InProcessGateway]]:
    """`count` gateways over the `decode` replicas, each with an empty affinity table, ready. Without a cache they never
    ask prefill (its address refuses connections): decode prefills every prompt itself."""
    with ExitStack() as stack:
        prefill = [refusing_address(stack)]
        started = []
        for _ in range(count):
            cfg = GatewayConfig(port=0, grpc_port=0, prefill=prefill, decode=decode, load_interval_s=0.1)
            gateway = InProcessGateway(cfg)
            stack.callback(gateway.stop)
            started.append(gateway)
        for gateway in started:
            wait_until(lambda g=gateway: httpx.get(g.base_url + "/health").json()["ready"], "the gateway to be ready")
        yield started


def routed(gateway: InProcessGateway, reason: str) -> float:
    value = gateway.server.registry.get_sample_value(
        "v41mesh_gateway_routed_total", {"role": "decode", "reason": reason}
    )
    return value or 0.0


class Conversation:
    """A chat whose turns each extend the previous turn's messages; with a session header or without."""

    def __init__(self, decodes: Decodes, name: str, session: str | None = None) -> None:
        self.decodes = decodes
        self.headers = {"x-session-id": session} if session else {}
        self.messages = [{"role": "user", "content": name}]

    def turn(self, gateway: InProcessGateway) -> str:
        """Send the next turn through `gateway`; the address of the decode replica that served it."""
        before = self.decodes.generations()
        body = {"model": MODEL, "messages": self.messages, "max_tokens": 1}
        response = httpx.post(
            gateway.base_url + "/v1/chat/completions", json=body, headers=self.headers, timeout=WAIT_S
        )
        assert response.status_code == 200, response.text
        wait_until(lambda: sum(self.decodes.generations()) == sum(before) + 1, "the replica to count the generation")
        after = self.decodes.generations()
        (served,) = [a for a, old, new in zip(self.decodes.addresses, before, after, strict=True) if new > old]
        turns = len(self.messages)
        self.messages += [{"role": "assistant", "content": f"answer {turns}"}, {"role": "user", "content": "go on"}]
        return served


def conversations(decodes: Decodes, tag: str) -> list[Conversation]:
    with_sessions = [Conversation(decodes, f"{tag} agent {i}", session=f"{tag}-session-{i}") for i in range(6)]
    return with_sessions + [Conversation(decodes, f"{tag} chat {i}") for i in range(6)]


def test_two_gateways_with_empty_tables_send_every_turn_of_a_conversation_to_one_replica(decodes: Decodes) -> None:
    chats = conversations(decodes, "agree")
    owners = []
    with gateways(decodes.addresses) as (first, second):
        for chat in chats:
            served = [chat.turn(gateway) for gateway in (first, second, first)]
            assert len(set(served)) == 1, f"{chat.messages[0]['content'][:20]}: turns went to {served}"
            owners.append(served[0])
        # The second gateway never saw a conversation before its turn: the hash chose every time. The first
        # gateway hashed each first turn and remembered the replica for the third.
        assert routed(second, "hash") == len(chats)
        assert (routed(first, "hash"), routed(first, "table")) == (len(chats), len(chats))
    assert len(set(owners)) > 1, "conversations spread over the replicas"


def test_a_replica_that_leaves_moves_only_the_conversations_it_owned(decodes: Decodes) -> None:
    chats = conversations(decodes, "leave")
    with gateways(decodes.addresses, count=1) as (gateway,):
        owners = [chat.turn(gateway) for chat in chats]
    leaving, _ = collections.Counter(owners).most_common(1)[0]
    staying = [address for address in decodes.addresses if address != leaving]
    moved = 0
    with gateways(staying) as (first, second):
        for chat, owner in zip(chats, owners, strict=True):
            served = {chat.turn(first), chat.turn(second)}
            assert len(served) == 1, f"the gateways disagree on a conversation that moved: {served}"
            if owner == leaving:
                moved += 1
            else:
                assert served == {owner}, "a conversation of a replica that stayed moved"
    assert 0 < moved < len(chats)
