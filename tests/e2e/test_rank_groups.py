"""`python -m mesh up --decode-ranks 2 --prefill-ranks 2`: the prefill and decode replicas run as groups of two rank
processes each (routed experts split over them) and serve the SDKs' requests —
Chat Completions streamed and not, Messages — through the whole mesh; SIGTERM stops every rank.

That a group computes what one process computes is tested at the service level, on fixed inputs without a cache
(tests/decode_svc/test_decode_ranks.py, tests/prefill_svc/test_prefill_ranks.py): the demo model's greedy text
through the mesh also moves with the cache's state (a prefix hit resumes with other float reduction orders), so it
is no oracle across meshes."""

from __future__ import annotations

import signal
from pathlib import Path

import anthropic
import openai
from e2e_helpers import START_TIMEOUT_S, mesh_up

MESSAGES = [{"role": "user", "content": "Name three colours of the sea at dusk."}]


def test_rank_groups_serve_the_sdks(tmp_path: Path) -> None:
    up, base_url = mesh_up(tmp_path, "--decode-ranks", "2", "--prefill-ranks", "2")
    try:
        oai = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        claude = anthropic.Anthropic(base_url=base_url, api_key="unused", max_retries=0, timeout=120)
        request = {"model": "DeepSeek-V4.1-Flash", "messages": MESSAGES, "max_tokens": 16}
        chat = oai.chat.completions.create(**request, temperature=0)
        assert chat.choices[0].message.content
        assert chat.choices[0].finish_reason in ("stop", "length")
        streamed = oai.chat.completions.create(**request, temperature=0, stream=True)
        pieces = [c.choices[0].delta.content or "" for c in streamed if c.choices]
        assert "".join(pieces)
        message = claude.messages.create(**request, extra_body={"temperature": 0})  # this SDK no longer names it
        assert message.content
        assert all(block.type in ("thinking", "text") for block in message.content)
        assert any(getattr(block, block.type) for block in message.content)  # its thinking or text, not empty
        assert message.stop_reason in ("end_turn", "max_tokens")
        up.send_signal(signal.SIGTERM)
        assert up.wait(START_TIMEOUT_S) == 0
        for part in ("prefill-0", "decode-0"):  # rank 1 of each group joined, rank 0 loaded its share and served
            log = (tmp_path / "logs" / f"{part}.log").read_text()
            assert '"event": "rank_ready"' in log
            assert '"WORLD_SIZE": "2"' in log
            assert '"event": "serving"' in log
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
