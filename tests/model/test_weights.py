"""Checkpoints: released tensor names and stored formats, bit-exact save → load, seeded init, fingerprints.

The checkpoint format does not depend on the vocabulary, so these tests use `tiny` with a 2,048-token vocabulary
(the embedding, head and Markov head of the real one would be 90 % of the bytes written and hashed).
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from model import build_model, checkpoint_fingerprint, load_checkpoint, model_fingerprint, save_checkpoint
from model.quant import fp4_dequant_ue8m0


def stored(directory) -> dict[str, torch.Tensor]:
    with safe_open(str(directory / "model.safetensors"), framework="pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)


@pytest.fixture(scope="module")
def args(tiny_args):
    return tiny_args.replace(vocab_size=2048, dspark_noise_token_id=2000)


@pytest.fixture(scope="module")
def model(args):
    return build_model(args, seed=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory, model):
    return save_checkpoint(model, tmp_path_factory.mktemp("ckpt"))


def test_released_names_and_formats(checkpoint, args):
    t = stored(checkpoint)
    a = args
    L2, D, C = a.n_encoder_layers, a.head_dim, a.hidden_size
    # FP8 weights: E4M3 data with one UE8M0 scale per 32×32 block.
    assert t["layers.0.attn.wq_a.weight"].dtype == torch.float8_e4m3fn
    assert t["layers.0.attn.wq_a.scale"].shape == (a.q_lora_rank // 32, C // 32)
    # Routed experts: packed FP4, [out, in/2], one UE8M0 scale per 32 inputs.
    w1 = t["layers.3.ffn.experts.1.w1.weight"]
    assert (w1.dtype, tuple(w1.shape)) == (torch.uint8, (a.moe_intermediate_size, C // 2))
    assert t["layers.3.ffn.experts.1.w1.scale"].shape == (a.moe_intermediate_size, C // 32)
    # Plain tensors and the ones only some layers own (reference §2.9).
    present = ["embed.weight", "head.weight", "norm.weight", "layers.1.hc_attn_fn", "layers.0.attn.attn_sink"]
    present += [f"layers.{L2}.attn.compressor.wkv.weight", f"layers.{L2}.attn.indexer.wk.weight"]
    present += ["layers.6.attn.indexer.wq_b.weight", "layers.2.attn.compressor.wgate.weight"]
    present += ["layers.1.engram.embed.scale", "layers.1.engram.q_weight", "layers.5.ffn.gate.bias_vl"]
    present += ["mtp.0.main_proj.weight", "mtp.2.markov_head.embed.weight", "mtp.2.confidence_head.proj.weight"]
    for name in present:
        assert name in t, name
    assert t[f"layers.{L2}.attn.compressor.wkv.weight"].shape == (D, C)
    for absent in (f"layers.{L2}.attn.compressor.wgate.weight", "layers.6.attn.indexer.wk.weight",
                   "layers.5.attn.indexer.wq_b.weight", "layers.0.engram.embed.weight", "hc_head_fn"):  # fmt: skip
        assert absent not in t, absent
    assert t["mtp.0.main_proj.weight"].shape == (C, len(a.dspark_target_layer_ids) * C)
    assert t["mtp.2.confidence_head.proj.weight"].shape == (1, C + a.dspark_markov_rank)


def test_save_load_round_trip_is_bit_exact(checkpoint, model):
    loaded = load_checkpoint(checkpoint)
    original, again = model.state_dict(), loaded.state_dict()
    assert original.keys() == again.keys()
    for name, value in original.items():
        assert torch.equal(value, again[name]), name
    assert loaded.fingerprint == checkpoint_fingerprint(checkpoint)
    # Saving the loaded model stores the same values (the packed forms decode to them).
    resaved = save_checkpoint(loaded, checkpoint.parent / "resaved")
    w = stored(resaved)["layers.3.ffn.experts.0.w2.weight"], stored(resaved)["layers.3.ffn.experts.0.w2.scale"]
    assert torch.equal(fp4_dequant_ue8m0(*w), model.state_dict()["layers.3.ffn.experts.0.w2.weight"])


def test_encoder_part_reads_only_its_tensors(checkpoint, tmp_path, model, args):
    t = stored(checkpoint)
    encoder_names = set(build_model(args, "encoder", seed=None, device="meta").state_dict())
    kept = {n: v for n, v in t.items() if n.removesuffix(".scale").removesuffix(".weight") in
            {e.removesuffix(".weight") for e in encoder_names}}  # fmt: skip
    assert len(kept) < len(t) / 2  # a prefill machine holds less than half of the tensors
    save_file(kept, str(tmp_path / "model.safetensors"))
    (tmp_path / "config.json").write_text((checkpoint / "config.json").read_text())
    encoder = load_checkpoint(tmp_path, "encoder")
    for name, value in encoder.state_dict().items():
        assert torch.equal(value, model.state_dict()[name]), name
    with pytest.raises(ValueError, match="lacks"):
        load_checkpoint(tmp_path, "full")


def test_seeded_init_is_deterministic(args, model):
    again, other = build_model(args, seed=0), build_model(args, seed=1)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters(), strict=True))
    assert not torch.equal(model.head.weight, other.head.weight)
    assert again.fingerprint == model.fingerprint != other.fingerprint
    # A prefill machine (encoder part) and a decode machine (full model) of one seed share weights and fingerprint.
    encoder = build_model(args, "encoder", seed=0)
    assert encoder.fingerprint == model.fingerprint
    assert all(torch.equal(v, model.state_dict()[n]) for n, v in encoder.state_dict().items())


def test_plain_checkpoint_round_trip(args, tmp_path):
    plain_args = args.replace(quantization_config=None)
    model = build_model(plain_args, seed=3)
    save_checkpoint(model, tmp_path)
    assert stored(tmp_path)["layers.0.attn.wq_a.weight"].dtype == torch.float32
    assert not any(n.endswith(".scale") for n in stored(tmp_path))
    assert json.loads((tmp_path / "config.json").read_text())["quantization_config"] is None
    loaded = load_checkpoint(tmp_path)
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), loaded.parameters(), strict=True))


def test_fingerprint_identifies_config_and_weights(tiny_args):
    w = {"a": torch.arange(4.0), "b": torch.ones(2, dtype=torch.bfloat16)}
    fp = model_fingerprint(tiny_args, w)
    assert len(fp) == 16
    assert fp == model_fingerprint(tiny_args, dict(reversed(w.items())))
    assert fp != model_fingerprint(tiny_args.replace(kv_block_tokens=32), w)
    assert fp != model_fingerprint(tiny_args, {**w, "a": torch.arange(4.0) + 1e-7})


def test_confidence_temperatures_load_when_present(checkpoint, tmp_path, model, args):
    """The calibrated per-position temperatures load from `mtp.{last}.confidence_head.temperature`; a checkpoint from
    before calibration (no such tensor) loads with T = 1; a non-positive temperature is refused."""
    name = f"mtp.{args.num_nextn_predict_layers - 1}.confidence_head.temperature"
    tensors = stored(checkpoint)
    assert torch.equal(tensors[name], torch.ones(args.dspark_block_size))  # saved with the model

    def load(variant: dict[str, torch.Tensor], where: str):
        (tmp_path / where).mkdir()
        save_file(variant, str(tmp_path / where / "model.safetensors"))
        (tmp_path / where / "config.json").write_text((checkpoint / "config.json").read_text())
        return load_checkpoint(tmp_path / where)

    calibrated = torch.linspace(0.5, 3.0, args.dspark_block_size)
    loaded = load({**tensors, name: calibrated}, "calibrated")
    assert torch.equal(loaded.mtp[-1].confidence_head.temperature, calibrated)
    old = load({n: t for n, t in tensors.items() if n != name}, "old")
    assert torch.equal(old.mtp[-1].confidence_head.temperature, torch.ones(args.dspark_block_size))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), old.parameters(), strict=True))
    with pytest.raises(ValueError, match="temperature must be positive and finite"):
        load({**tensors, name: -calibrated}, "negative")
    # The same holds for an in-memory state dict (the trainer's saved phases).
    fresh = build_model(args, seed=None)
    fresh.mtp[-1].confidence_head.temperature.fill_(2.0)
    fresh.load_state_dict({n: t for n, t in model.state_dict().items() if n != name})
    assert torch.equal(fresh.mtp[-1].confidence_head.temperature, torch.ones(args.dspark_block_size))
