"""Routing: least load, bounded conversation affinity (a conversation named by its session header or its opening goes
to the replica this gateway remembers, else to its rendezvous owner), replicas routed around."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable

from prometheus_client import CollectorRegistry

from gateway import rendezvous
from gateway.affinity import AffinityKey, AffinityTable, session_of
from gateway.discovery import StaticDiscovery
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaPool, ReplicaState
from gateway.router import Router
from mesh.metrics import new_registry
from mesh.processes import free_port

A, B, C = "127.0.0.1:7101", "127.0.0.1:7102", "127.0.0.1:7103"


def with_router(
    check: Callable[[Router, dict[str, ReplicaState]], Awaitable[None]],
    *,
    slack: float = 1.0,
    capacity: int = 100,
    registry: CollectorRegistry | None = None,
) -> None:
    async def scenario() -> None:
        discovery = StaticDiscovery([A, B], [A, B, C])
        metrics = GatewayMetrics(registry or new_registry())
        pools = {role: ReplicaPool(role, discovery, metrics, inhibit_s=60.0) for role in ("prefill", "decode")}
        router = Router(pools, AffinityTable(capacity), slack, metrics)  # type: ignore[arg-type]
        states = {s.name: s for s in pools["decode"].states()}
        try:
            await check(router, states)
        finally:
            await asyncio.gather(*(p.close() for p in pools.values()))

    asyncio.run(scenario())


def key(opening: bytes | None = None, session: str | None = None) -> AffinityKey:
    """A request's conversation key (its prompt's block keys play no part in routing)."""
    return AffinityKey(session, (b"system-header",), opening)


def routed(registry: CollectorRegistry, reason: str, role: str = "decode") -> float:
    return registry.get_sample_value("v41mesh_gateway_routed_total", {"role": role, "reason": reason}) or 0.0


def test_least_loaded_wins_and_ties_rotate() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        states[A].reported, states[B].reported, states[C].reported = 3, 1, 2
        assert router.pick("decode", key()).name == B  # no session, no user message: no conversation
        for s in states.values():
            s.reported, s.sent_since_poll = 0, 0
        picked = [router.pick("decode", key()).name for _ in range(6)]
        assert sorted(picked) == sorted([A, B, C] * 2)  # a burst between polls spreads evenly
        for s in states.values():
            s.sent_since_poll = 0
        # Without slack a conversation's owner wins only while it is as idle as any: new conversations spread too.
        router.slack = 0.0
        picked = [router.pick("decode", key(bytes([i]))).name for i in range(6)]
        assert sorted(picked) == sorted([A, B, C] * 2)

    with_router(check)


def test_load_is_per_batch_slot() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        states[A].reported, states[A].capacity = 8, 16  # half full
        states[B].reported, states[B].capacity = 2, 2  # full
        states[C].reported, states[C].capacity = 6, 8
        assert router.pick("decode", key()).name == A

    with_router(check, slack=0.0)


def test_a_conversation_returns_to_its_replica() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        conversation = key(b"opening")
        chosen = router.pick("decode", conversation)
        router.served("decode", conversation, chosen)
        for name, state in states.items():
            state.reported = 1.0 if name == chosen.name else 0.0  # its replica is now a little busier
            state.sent_since_poll = 0
        assert router.pick("decode", conversation).name == chosen.name
        assert (routed(registry, "hash"), routed(registry, "table")) == (1, 1)

    registry = new_registry()
    with_router(check, registry=registry)


def test_a_conversation_this_gateway_never_saw_goes_to_its_rendezvous_owner_as_on_every_gateway() -> None:
    """Two gateways with empty tables agree on every conversation: by session, or by the opening its turns share; a
    retry (the owner excluded) goes to the next owner, again the same on both."""

    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        other = Router(router.pools, AffinityTable(100), router.slack, GatewayMetrics(new_registry()))
        owners = set()
        for i in range(30):
            for conversation in (key(session=f"agent-{i}"), key(b"chat-%d" % i)):
                mine = router.pick("decode", conversation)
                assert other.pick("decode", conversation).name == mine.name
                assert mine.name == rendezvous.owner(conversation.conversation, [A, B, C])  # type: ignore[arg-type]
                retry = router.pick("decode", conversation, exclude={mine.name})
                assert retry.name != mine.name
                assert other.pick("decode", conversation, exclude={mine.name}).name == retry.name
                owners.add(mine.name)
                for s in states.values():
                    s.sent_since_poll = 0
        assert owners == {A, B, C}
        assert routed(registry, "hash") == 4 * 30
        assert routed(registry, "table") == routed(registry, "load") == routed(registry, "slack") == 0

    registry = new_registry()
    with_router(check, registry=registry)


def test_the_slack_overrides_a_busy_hashed_owner_and_the_table_outranks_the_hash() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        conversation = key(b"hello")
        owner = rendezvous.owner(conversation.conversation, [A, B, C])  # type: ignore[arg-type]
        states[owner].reported = 3
        chosen = router.pick("decode", conversation)
        assert chosen.name != owner  # 3 > 0 + 1: a hot prompt does not pile everything on its owner
        assert routed(registry, "slack") == 1
        router.served("decode", conversation, chosen)  # this gateway remembers where the turn went
        states[owner].reported, chosen.sent_since_poll = 0, 0
        assert router.pick("decode", conversation).name == chosen.name
        assert routed(registry, "table") == 1
        chosen.sent_since_poll = 0
        router.pools["decode"].failed(chosen)  # the remembered replica is out: the conversation's owner again
        assert router.pick("decode", conversation).name == owner

    registry = new_registry()
    with_router(check, registry=registry)


def test_affinity_yields_to_load_beyond_the_slack() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        conversation = key(b"p", session="s-1")
        router.served("decode", conversation, states[A])
        states[A].reported, states[B].reported, states[C].reported = 3, 1, 1
        assert router.pick("decode", conversation).name != A  # 3 > 1 + 1
        for s in states.values():
            s.sent_since_poll = 0
        states[A].reported = 2
        assert router.pick("decode", conversation).name == A  # 2 <= 1 + 1

    with_router(check)


def test_session_header_outranks_the_opening() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        router.served("decode", key(b"p"), states[B])
        router.served("decode", key(session="agent-7"), states[C])
        assert router.pick("decode", key(b"p", session="agent-7")).name == C
        # A session new here is its own conversation, though its opening is another's: its owner decides.
        new = key(b"p", session="agent-8")
        assert router.pick("decode", new).name == rendezvous.owner(new.conversation, [A, B, C])  # type: ignore[arg-type]
        assert session_of({"x-claude-code-session-id": "abc"}) == "abc"
        assert session_of({"content-type": "application/json"}) is None

    with_router(check, slack=10.0)


def test_failed_draining_and_down_replicas_get_no_work() -> None:
    async def check(router: Router, states: dict[str, ReplicaState]) -> None:
        router.pools["decode"].failed(states[A])
        states[B].draining = True
        assert router.pick("decode", key()).name == C
        states[C].up = False
        # No healthy decode replica: rather than refuse, decode tries those ruled out by health (never draining).
        assert {router.pick("decode", key(bytes([i]))).name for i in range(4)} == {A, C}
        prefill = {s.name: s for s in router.pools["prefill"].states()}
        prefill[A].up = False
        assert router.pick("prefill", key()).name == B
        router.pools["prefill"].failed(prefill[B])
        assert router.pick("prefill", key()) is None  # prefill has a fallback: decode prefills itself

    with_router(check)


def test_a_poll_marks_an_unreachable_replica_down() -> None:
    async def scenario() -> None:
        dead = f"127.0.0.1:{free_port()}"  # nothing listens there
        pool = ReplicaPool("decode", StaticDiscovery([dead], [dead]), GatewayMetrics(new_registry()), inhibit_s=5.0)
        (state,) = pool.states()
        assert state.up is None
        assert state.routable(0.0)
        await pool.poll()
        assert state.up is False
        assert pool.routable(set()) == []
        await pool.close()

    asyncio.run(scenario())


def test_affinity_table_is_bounded_and_forgets_departed_replicas() -> None:
    table = AffinityTable(capacity=2)
    table.remember("decode", key(b"1"), "r1")
    table.remember("decode", key(b"2"), "r2")
    table.remember("decode", key(b"1"), "r3")  # served again, elsewhere: the latest replica, and the newest entry
    table.remember("decode", key(b"4"), "r1")  # evicts the least recently served: b"2"
    table.remember("decode", key(), "r1")  # nameless: nothing to remember
    assert [table.lookup("decode", key(o)) for o in (b"1", b"2", b"4")] == ["r3", None, "r1"]
    assert table.lookup("decode", key()) is None
    assert table.lookup("prefill", key(b"1")) is None  # per role
    table.forget("decode", "r3")
    assert table.lookup("decode", key(b"1")) is None
