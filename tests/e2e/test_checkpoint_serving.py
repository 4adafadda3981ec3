"""A synthetic checkpoint in the released layout, written by `python -m model.checkpoint write`, served end to end by
`python -m mesh up --model DIR`: every replica loads it packed (the Engram tables in host memory, or mapped from the
shards), the gateway answers through prefill and decode."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from pathlib import Path

import openai
import pytest
from e2e_helpers import START_TIMEOUT_S, mesh_up

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(("preset", "engram_store"), [("tiny", "mmap"), ("demo", "host")])
def test_mesh_serves_a_released_layout_checkpoint(tmp_path: Path, preset: str, engram_store: str) -> None:
    checkpoint = tmp_path / preset
    written = subprocess.run(
        [sys.executable, "-m", "model.checkpoint", "write", "--preset", preset, "--out", str(checkpoint),
         "--seed", "5", "--shard-mib", "8", "--device", "cpu"],
        cwd=ROOT, capture_output=True, text=True, timeout=START_TIMEOUT_S,
    )  # fmt: skip
    assert written.returncode == 0, written.stderr
    shards = sorted(checkpoint.glob("model-*-of-*.safetensors"))
    assert len(shards) > 1
    assert (checkpoint / "model.safetensors.index.json").exists()
    data_dir = tmp_path / "mesh"
    up, base_url = mesh_up(data_dir, "--model", str(checkpoint), "--engram-store", engram_store)
    try:
        client = openai.OpenAI(base_url=base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
        reply = client.chat.completions.create(
            model="DeepSeek-V4.1-Flash", messages=[{"role": "user", "content": "Hello!"}], max_tokens=4, temperature=0
        )
        assert reply.usage.completion_tokens >= 1
        assert reply.usage.prompt_tokens > 1
        assert reply.choices[0].finish_reason in ("stop", "length", "tool_calls")
        up.send_signal(signal.SIGTERM)
        assert up.wait(START_TIMEOUT_S) == 0
        logs = "".join(p.read_text() for p in (data_dir / "logs").glob("*.log"))
        loaded = [json.loads(line) for line in logs.splitlines() if '"model_loaded"' in line]
        assert {entry["part"] for entry in loaded} == {"encoder", "full"}
        assert {entry["engram_store"] for entry in loaded} == {engram_store}
        for entry in loaded:  # each part read only its own tensors, straight into packed storage
            assert 0 < entry["checkpoint_bytes"] <= entry["weight_bytes"]
    finally:
        if up.poll() is None:
            up.kill()
            up.wait()
