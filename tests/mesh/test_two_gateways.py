"""Two gateways over one mesh (`MeshSpec.gateway_replicas=2`), as behind a load balancer without stickiness: both
come up on ports of their own in front of the same cache, prefill and two decode replicas (real processes, the tiny
model, loopback), each serves a chat completion, a conversation's second turn sent to the OTHER gateway reaches the
decode replica that served its first turn (its rendezvous owner, the same on every gateway: docs/gateway.md,
"Routing"), and stop() ends every process."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import openai

from mesh.processes import Mesh, MeshSpec

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "e2e"))
from e2e_helpers import MODEL, START_TIMEOUT_S, metric  # the end-to-end tests' metric reader

CACHE_ARGS = ["--ssd-bytes", str(64 << 20), "--dram-bytes", str(16 << 20), "--record-bytes", str(16 << 20)]


def first_tokens(mesh: Mesh) -> list[float]:
    """Generate calls each decode replica has sent a first token for (counted before the token leaves it)."""
    decodes = [c for c in mesh.children if c.name.startswith("decode")]
    return [metric(c.metrics.removesuffix("/metrics"), "v41mesh_decode_ttft_seconds_count") for c in decodes]


def served_by(mesh: Mesh, client: openai.OpenAI, messages: list[dict[str, str]]) -> tuple[int, str]:
    """Send one turn; return the index of the decode replica that generated it and the reply's text."""
    before = first_tokens(mesh)
    reply = client.chat.completions.create(
        model=MODEL, messages=messages, max_tokens=4, temperature=0, extra_body={"thinking": {"type": "disabled"}}
    )
    grown = [index for index, (b, a) in enumerate(zip(before, first_tokens(mesh), strict=True)) if a > b]
    assert len(grown) == 1, f"expected one decode replica to generate the turn, counters {before} → grown {grown}"
    return grown[0], reply.choices[0].message.content or "(no text)"


def test_two_gateways_serve_and_agree_on_a_conversations_decode_replica(tmp_path: Path) -> None:
    spec = MeshSpec(model="tiny", data_dir=tmp_path, decode_replicas=2, gateway_replicas=2, cache_args=CACHE_ARGS)
    with Mesh(spec) as mesh:
        assert mesh.base_url == mesh.base_urls[0]
        assert len(set(mesh.base_urls)) == 2
        state = json.loads((tmp_path / "mesh.json").read_text())
        assert state["base_urls"] == mesh.base_urls
        assert {"gateway-0", "gateway-1"} <= set(state["children"])
        clients = [
            openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=START_TIMEOUT_S)
            for url in mesh.base_urls
        ]
        for first, other in ((0, 1), (1, 0)):  # one conversation opened on each gateway
            opening = {"role": "user", "content": f"Conversation {first}: list the files in the repository."}
            replica, text = served_by(mesh, clients[first], [opening])
            hashed = metric(mesh.base_urls[other], "v41mesh_gateway_routed_total", role="decode", reason="hash")
            turn = [opening, {"role": "assistant", "content": text}, {"role": "user", "content": "Now the tests."}]
            assert served_by(mesh, clients[other], turn)[0] == replica
            # The other gateway never saw the conversation: its rendezvous owner chose, not its affinity table.
            after = metric(mesh.base_urls[other], "v41mesh_gateway_routed_total", role="decode", reason="hash")
            assert after == hashed + 1
    assert not any(child.running() for child in mesh.children)
