"""The committed demo checkpoint: released formats, ≤ 48 MB, loaded by the release loader, and served by the whole
mesh (real processes on loopback, the gateway's HTTP API through the real openai SDK) well enough to call a tool."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import msgspec
import openai
import torch
from safetensors import safe_open

from mesh.processes import Mesh
from model import load_checkpoint, preset
from recipe.tokenizer import default_tokenizer_path
from train import tools

CHECKPOINT = Path(__file__).resolve().parents[2] / "model" / "checkpoints" / "v41-demo"
MODEL = "DeepSeek-V4.1-Flash"
GREEDY = {"temperature": 0, "extra_body": {"thinking": {"type": "disabled"}}}
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": tools.WEATHER.name,
        "description": tools.WEATHER.description,
        "parameters": tools.WEATHER.parameters,
    },
}


def _tensors() -> dict[str, torch.Tensor]:
    out = {}
    for shard in sorted(CHECKPOINT.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            out |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return out


def test_checkpoint_is_small_and_in_the_released_formats() -> None:
    assert sum(f.stat().st_size for f in CHECKPOINT.iterdir()) <= 48 * 10**6
    index = json.loads((CHECKPOINT / "model.safetensors.index.json").read_text())
    tensors = _tensors()
    assert set(index["weight_map"]) == set(tensors)
    assert all((CHECKPOINT / shard).stat().st_size <= 16 * 2**20 for shard in set(index["weight_map"].values()))
    assert tensors["embed.weight"].dtype == torch.bfloat16
    assert tensors["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn  # FP8, 32×32 blocks + UE8M0 scales
    assert tensors["layers.0.attn.wq_a.scale"].dtype == torch.uint8
    expert = tensors["layers.0.ffn.experts.0.w1.weight"]  # packed FP4: two E2M1 codes per byte
    assert expert.dtype == torch.uint8
    assert expert.shape[1] * 2 == tensors["layers.0.ffn.shared_experts.w1.weight"].shape[1]
    reference = json.loads((CHECKPOINT / "tokenizer_config.json").read_text())
    assert reference["sha256"] == hashlib.sha256(default_tokenizer_path().read_bytes()).hexdigest()


def test_checkpoint_loads_through_the_release_loader() -> None:
    model = load_checkpoint(CHECKPOINT)
    assert model.args == preset("demo")
    assert model.fingerprint  # identifies these weights in prefix-cache keys
    with torch.no_grad():
        logits = model(torch.tensor([[0, 128803, 19923, 3]]))
    assert torch.isfinite(logits).all()


def test_weather_question_calls_get_weather_and_answers_the_result(demo_mesh: Mesh) -> None:
    client = openai.OpenAI(base_url=demo_mesh.base_url + "/v1", api_key="unused", max_retries=0, timeout=120)
    messages: list[dict] = [{"role": "user", "content": "What's the weather in Paris?"}]
    first = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=64, **GREEDY
    )
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice.message
    call = choice.message.tool_calls[0]
    assert call.function.name == "get_weather"
    arguments = msgspec.json.decode(call.function.arguments)
    assert isinstance(arguments.get("location"), str)
    assert arguments["location"]
    messages += [
        {"role": "assistant", "content": "", "tool_calls": [call.model_dump()]},
        {
            "role": "tool",
            "tool_call_id": call.id,
            "content": tools.run_tool(call.function.name, call.function.arguments),
        },
    ]
    second = client.chat.completions.create(
        model=MODEL, messages=messages, tools=[WEATHER_TOOL], max_tokens=48, **GREEDY
    )
    assert second.choices[0].message.content.strip()
    assert not second.choices[0].message.tool_calls
