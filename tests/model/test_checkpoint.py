"""Checkpoints in the released layout: names, stored dtypes, shards and index; bit-exact round trips; a part reads
only its tensors; precise refusals; the header-only fingerprint; the `python -m model.checkpoint` CLI."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import build_model, checkpoint_fingerprint, load_checkpoint, preset, save_checkpoint
from model.checkpoint import INDEX_FILE, Checkpoint, main, write_seeded
from model.weights import expected_names, weight_bytes


def stored(directory) -> dict[str, torch.Tensor]:
    tensors = {}
    for shard in sorted(directory.glob("*.safetensors")):
        with safe_open(str(shard), framework="pt") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return tensors


def rewrite(directory, tensors: dict[str, torch.Tensor], config_from) -> None:
    """A one-file checkpoint (no index) holding `tensors`, with another checkpoint's config."""
    directory.mkdir()
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text((config_from / "config.json").read_text())


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, narrow):
    return save_checkpoint(narrow, tmp_path_factory.mktemp("ckpt") / "tiny", shard_bytes=64 << 10)


def test_released_layout_names_and_dtypes(checkpoint, narrow_args):
    t = stored(checkpoint)
    a = narrow_args
    L2, C, I = a.n_encoder_layers, a.hidden_size, a.moe_intermediate_size
    index = json.loads((checkpoint / INDEX_FILE).read_text())
    shards = sorted(p.name for p in checkpoint.glob("*.safetensors"))
    assert len(shards) > 1
    assert shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert set(index["weight_map"]) == set(t)
    assert set(index["weight_map"].values()) == set(shards)
    assert index["metadata"]["total_size"] == sum(v.numel() * v.element_size() for v in t.values())
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["DeepseekV41ForCausalLM"]
    assert config["text_config"]["hidden_size"] == C
    # FP8 weights: E4M3 data with one UE8M0 scale per 32×32 block.
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].dtype == torch.float8_e8m0fnu
    assert t["layers.0.attn.wq_a.scale"].shape == (a.q_lora_rank // 32, C // 32)
    # Routed experts: packed FP4 (two per byte) [out, in/2], one UE8M0 scale per 32 inputs.
    w1 = t["layers.3.ffn.experts.1.w1.weight"]
    assert (w1.dtype, tuple(w1.shape)) == (torch.float4_e2m1fn_x2, (I, C // 2))
    assert t["layers.3.ffn.experts.1.w1.scale"].shape == (I, C // 32)
    present = ["embed.weight", "head.weight", "norm.weight", "layers.1.hc_attn_fn", "layers.0.attn.attn_sink"]
    present += [f"layers.{L2}.attn.compressor.wkv.weight", f"layers.{L2}.attn.indexer.wk.weight"]
    present += ["layers.6.attn.indexer.wq_b.weight", "layers.2.attn.compressor.wgate.weight"]
    present += ["layers.1.engram.embed.scale", "layers.1.engram.q_weight", "layers.5.ffn.gate.bias_vl"]
    present += ["mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight"]
    for name in present:
        assert name in t, name
    assert t["embed.weight"].dtype == torch.float32  # plain tensors in the model's dtype
    for absent in (f"layers.{L2}.attn.compressor.wgate.weight", "layers.6.attn.indexer.wk.weight",
                   "layers.5.attn.indexer.wq_b.weight", "layers.0.engram.embed.weight", "hc_head_fn",
                   "layers.3.ffn.experts.w13"):  # fmt: skip
        assert absent not in t, absent


def test_round_trip_is_bit_exact(checkpoint, narrow):
    loaded = load_checkpoint(checkpoint)
    assert loaded.state_dict().keys() == narrow.state_dict().keys()
    for name, value in narrow.state_dict().items():
        assert torch.equal(value, loaded.state_dict()[name]), name
    assert loaded.fingerprint == checkpoint_fingerprint(checkpoint) != narrow.fingerprint
    report = loaded.load_report
    assert report.read_bytes == Checkpoint(checkpoint).nbytes
    assert report.gb_per_s > 0
    # Saving the loaded model stores the same tensors; the float form loads the values the bytes decode to.
    again = stored(save_checkpoint(loaded, checkpoint.parent / "resaved"))
    assert all(torch.equal(v.view(torch.uint8), again[n].view(torch.uint8)) for n, v in stored(checkpoint).items())
    float_form = load_checkpoint(checkpoint, packed=False)
    float_seeded = build_model(narrow.args, seed=0, packed=False)
    assert all(torch.equal(v, float_seeded.state_dict()[n]) for n, v in float_form.state_dict().items())


def test_encoder_part_reads_only_its_tensors(checkpoint, narrow, narrow_args):
    encoder = load_checkpoint(checkpoint, "encoder")
    total = Checkpoint(checkpoint).nbytes
    assert encoder.load_report.read_bytes == weight_bytes(encoder) < total / 2
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, narrow.state_dict()[name]), name


def test_a_part_needs_every_tensor_it_holds(checkpoint, narrow_args, tmp_path):
    t = stored(checkpoint)
    encoder_names = expected_names(build_model(narrow_args, "encoder", seed=None, device="meta"))
    rewrite(tmp_path / "enc", {n: v for n, v in t.items() if n in encoder_names}, checkpoint)
    load_checkpoint(tmp_path / "enc", "encoder")
    with pytest.raises(ValueError, match="lacks"):
        load_checkpoint(tmp_path / "enc", "full")
    rewrite(tmp_path / "noscale", {n: v for n, v in t.items() if n != "layers.0.attn.wkv.scale"}, checkpoint)
    with pytest.raises(ValueError, match=r"lacks 1 tensors.*layers\.0\.attn\.wkv\.scale"):
        load_checkpoint(tmp_path / "noscale")


@pytest.mark.parametrize(
    ("name", "value", "message"),
    [
        (
            "layers.0.attn.wo_a.weight",
            lambda t: t.to(torch.float8_e4m3fn),
            "wo_a.weight: checkpoint dtype float8_e4m3fn",
        ),
        ("layers.0.attn.wq_a.weight", lambda t: t.float(), "wq_a.weight: checkpoint dtype float32, expected float8"),
        ("layers.3.ffn.experts.0.w2.weight", lambda t: t.view(torch.uint8)[:, :-1], "w2.weight: checkpoint shape"),
        ("layers.0.attn.wq_a.scale", lambda t: t.view(torch.uint8).float(), "wq_a.scale: checkpoint dtype float32"),
    ],
)
def test_a_wrong_tensor_is_refused_by_name(checkpoint, tmp_path, name, value, message):
    """Never a silent cast: an FP8 tensor in a plain slot, a float in an FP8 or scale slot, a wrong shape."""
    t = stored(checkpoint)
    rewrite(tmp_path / "bad", {**t, name: value(t[name]).contiguous()}, checkpoint)
    with pytest.raises(ValueError, match=message):
        load_checkpoint(tmp_path / "bad")


def test_expert_scale_block_is_read_off_the_shapes(tiny_args, tmp_path, tokens):
    """Scales per 16 inputs load as such; a scale shape that is neither 16 nor 32 is refused, naming the tensor."""
    args, q = tiny_args, tiny_args.quantization_config
    args16 = args.replace(quantization_config=type(q)(**{**q.__dict__, "expert_scale_block": 16}))
    written = write_seeded(tmp_path / "b16", args16, seed=2, dtype=torch.bfloat16)
    config = json.loads((written / "config.json").read_text())
    config["quantization_config"].pop("expert_scale_block")  # as released: the shapes decide
    (written / "config.json").write_text(json.dumps(config))
    loaded = load_checkpoint(written, dtype=torch.bfloat16)
    assert loaded.args.quantization_config.expert_scale_block == 16
    ids = tokens(9).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids), build_model(args16, seed=2, dtype=torch.bfloat16)(ids))
    t = stored(written)
    name = "layers.2.ffn.experts.0.w1.scale"
    rewrite(tmp_path / "b8", {**t, name: torch.zeros(t[name].shape[0], args.hidden_size // 8, dtype=torch.uint8)},
            written)  # fmt: skip
    with pytest.raises(ValueError, match=rf"{name}: scale shape .* neither \[I, C/32\] nor \[I, C/16\]"):
        load_checkpoint(tmp_path / "b8")


def test_fingerprint_reads_headers_not_payloads(narrow_args, tmp_path):
    """Different seeds → different fingerprints (the writer's identity is in every header); a payload byte changed
    behind the header's back does not move it — the fingerprint never reads a payload."""
    a = write_seeded(tmp_path / "a", narrow_args, seed=0, dtype=torch.float32)
    b = write_seeded(tmp_path / "b", narrow_args, seed=1, dtype=torch.float32)
    assert checkpoint_fingerprint(a) != checkpoint_fingerprint(b)
    before = checkpoint_fingerprint(a)
    shard = sorted(a.glob("*.safetensors"))[-1]
    data = bytearray(shard.read_bytes())
    data[-1] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert checkpoint_fingerprint(a) == before


def test_synthetic_checkpoint_equals_the_seeded_model(tmp_path, capsys, tokens):
    """`python -m model.checkpoint write` stores what `build_model(seed=…)` holds: the loaded model's logits are the
    in-memory model's, and its weight memory is the checkpoint's bytes (bf16, as released)."""
    args = preset("tiny")
    assert main(["write", "--preset", "tiny", "--out", str(tmp_path / "w"), "--seed", "3", "--shard-mib", "1",
                 "--device", "cpu"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "fingerprint" in out
    assert len(list((tmp_path / "w").glob("*.safetensors"))) > 1
    loaded = load_checkpoint(tmp_path / "w", dtype=torch.bfloat16)
    assert weight_bytes(loaded) == loaded.load_report.read_bytes == Checkpoint(tmp_path / "w").nbytes
    ids = tokens(10).unsqueeze(0)
    with torch.no_grad():
        assert torch.equal(loaded(ids), build_model(args, seed=3, dtype=torch.bfloat16)(ids))
    assert main(["info", str(tmp_path / "w")]) == 0
    assert checkpoint_fingerprint(tmp_path / "w").hex() in capsys.readouterr().out


def test_confidence_temperatures_load_when_present(checkpoint, tmp_path, narrow, narrow_args):
    """The calibrated per-position temperatures load from `mtp.{last}.confidence_head.temperature`; a checkpoint from
    before calibration (no such tensor) loads with T = 1; a non-positive temperature is refused."""
    name = f"mtp.{narrow_args.num_nextn_predict_layers - 1}.confidence_head.temperature"
    tensors = stored(checkpoint)
    assert torch.equal(tensors[name], torch.ones(narrow_args.dspark_block_size))  # saved with the model

    calibrated = torch.linspace(0.5, 3.0, narrow_args.dspark_block_size)
    rewrite(tmp_path / "calibrated", {**tensors, name: calibrated}, checkpoint)
    assert torch.equal(load_checkpoint(tmp_path / "calibrated").mtp[-1].confidence_head.temperature, calibrated)
    rewrite(tmp_path / "old", {n: t for n, t in tensors.items() if n != name}, checkpoint)
    old = load_checkpoint(tmp_path / "old")
    assert torch.equal(old.mtp[-1].confidence_head.temperature, torch.ones(narrow_args.dspark_block_size))
    rewrite(tmp_path / "negative", {**tensors, name: -calibrated}, checkpoint)
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        load_checkpoint(tmp_path / "negative")
    # The same holds for an in-memory state dict (the trainer's saved phases).
    fresh = build_model(narrow_args, seed=None, packed=False)
    fresh.mtp[-1].confidence_head.temperature.fill_(2.0)
    float_state = build_model(narrow_args, seed=0, packed=False).state_dict()
    fresh.load_state_dict({n: t for n, t in float_state.items() if n != name})
    assert torch.equal(fresh.mtp[-1].confidence_head.temperature, torch.ones(narrow_args.dspark_block_size))


def test_plain_checkpoint_round_trip(narrow_args, tmp_path):
    plain_args = narrow_args.replace(quantization_config=None)
    model = build_model(plain_args, seed=3)
    save_checkpoint(model, tmp_path / "plain")
    t = stored(tmp_path / "plain")
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float32
    assert not any(n.endswith(".scale") for n in t)
    assert json.loads((tmp_path / "plain" / "config.json").read_text())["quantization_config"] is None
    loaded = load_checkpoint(tmp_path / "plain")
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True))
