"""Accounting against the issue's numbers (reference §3), and its CLI."""

from __future__ import annotations

import json

import pytest

from model import preset
from model.accounting import CONTEXTS, _matmul_params, account, decode_flops, main


@pytest.fixture(scope="module")
def v41():
    return account("v41-flash")


def test_global_kv_and_swa_ring(v41):
    assert v41.global_kv_bytes_per_token == 890
    assert (v41.main_kv_bytes_per_token, v41.index_k_bytes_per_token) == (720, 170)
    assert v41.swa_ring_bytes_per_sequence == 2_703_360
    assert v41.dspark_ring_bytes_per_sequence == 3 * 128 * 528
    assert account("v4-flash").global_kv_bytes_per_token == 3514.25


@pytest.mark.parametrize(
    ("key", "billions"),
    [("backbone", 551.6), ("decode_active", 16.5), ("prefill_active", 8.3), ("engram", 196.6), ("dspark", 14.2)],
)
def test_parameter_counts_within_one_percent(v41, key, billions):
    assert getattr(v41, f"params_{key}") == pytest.approx(billions * 1e9, rel=0.01)


def test_native_weight_bytes(v41):
    """Routed experts (backbone and DSpark) as packed FP4 with a UE8M0 scale per 32 inputs: 0.53125 B/param, split
    over the expert-parallel ranks; the rest replicated; the Engram tables (E4M3 + UE8M0/32) in host memory."""
    a = preset("v41-flash")
    expert = 3 * a.hidden_size * a.moe_intermediate_size
    routed = (a.num_hidden_layers * a.n_routed_experts + 3 * a.dspark_n_routed_experts) * expert * (0.5 + 1 / 32)
    assert v41.weight_bytes_routed == routed
    assert set(v41.weight_bytes_per_device) == {"1", "2", "4", "8"}
    for w, per_rank in v41.weight_bytes_per_device.items():
        assert per_rank == -(-v41.weight_bytes_routed // int(w)) + v41.weight_bytes_replicated
    assert 45 * 2**30 < v41.weight_bytes_per_device["8"] < 60 * 2**30  # a decode group of 8 H200s holds it
    assert v41.engram_host_bytes == sum(a.engram_num_embeddings) * a.engram_head_dim * (1 + 1 / 32)
    # The encoder half: 20 of 40 layers, no head and no DSpark — just under half of one EP-1 replica.
    assert 0.45 < v41.weight_bytes_encoder_half / v41.weight_bytes_per_device["1"] < 0.5


def test_flop_model_is_consistent_with_the_instantiated_model(v41):
    """The analytic per-token matmul weights (the FLOP model) agree with the meta-counted decode-active weights
    minus the embedding table (a lookup, not a matmul) plus the Engram projections (active, counted apart)."""
    a = preset("v41-flash")
    engram_proj = 2 * 3 * 8 * 256 * 5 * 5120
    counted = v41.params_decode_active - a.vocab_size * a.hidden_size + engram_proj
    assert sum(_matmul_params(a).values()) == pytest.approx(counted, rel=0.002)


def test_decode_flops_grow_slowly_for_v41_and_fast_for_v4():
    def growth(name: str) -> float:
        a = preset(name)
        return decode_flops(a, CONTEXTS[-1])["weighted"] / decode_flops(a, CONTEXTS[0])["weighted"]

    growth = {name: growth(name) for name in ("v41-flash", "v4-flash")}
    assert growth["v41-flash"] < 1.3 < 3 < growth["v4-flash"]


def test_cli_json_and_plot(tmp_path, capsys):
    plot = tmp_path / "acc.png"
    assert main(["--preset", "tiny", "--json", "--plot", str(plot)]) == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("global_kv_bytes_per_token", "swa_ring_bytes_per_sequence", "params_total", "params_backbone",
                "params_engram", "params_decode_active", "params_prefill_active", "weight_bytes_encoder_half",
                "engram_host_bytes"):  # fmt: skip
        assert isinstance(report[key], (int, float)), key
    assert set(report["weight_bytes_per_device"]) == {"1", "2", "4", "8"}
    assert main(["--preset", "tiny"]) == 0
    assert "expert-parallel size" in capsys.readouterr().out
    assert plot.stat().st_size > 10_000
    with pytest.raises(SystemExit) as exit_info:
        main(["--preset", "nope"])
    assert exit_info.value.code == 2
    assert "unknown model preset 'nope'" in capsys.readouterr().err
