"""The packed model on the GPU's path (every kernel op on Triton, run by its interpreter here): where a small batch's
FP8 linears cast their float inputs inside their GEMMs (`kernels.casts_in_gemm`), a decode step launches fewer cast
kernels and gives the logits, bit for bit, of the same step with every cast its own launch; a sublayer site's input
and c^Q are cast by their norm's kernel (`linear.norm_share`), with the logits of the norm and the cast apart, and
the shared expert's hidden by its SwiGLU's; sibling linears of one input run as one GEMM
(`linear.project_together`)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
import triton.runtime.interpreter as interpreter

from model import DecodeBatch, ModelArgs, build_model, encode_prefill, kernels, linear
from model.kernels import act_cast, fp8_gemm
from model.kernels.kv_quant import FP8_UE8M0, quantize_triton


def step(args: ModelArgs, prompts: list[list[int]]) -> tuple[torch.Tensor, Counter[str]]:
    """Logits of one decode step after `prompts` (prefilled on the torch path), the step on Triton, and the kernels it
    launched by name."""
    model = build_model(args, seed=0, dtype=torch.float32)
    batch = DecodeBatch(model, graphs=False)
    for prompt in prompts:
        out = encode_prefill(model, prompt)
        batch.join(out.blocks, out.encoder_state)
    launched, run = Counter[str](), interpreter.GridExecutor.__call__

    def count(executor, *a, **k):
        launched[executor.fn.__name__] += 1
        return run(executor, *a, **k)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(kernels, "backend_for", lambda _t: "triton")
        patch.setattr(interpreter.GridExecutor, "__call__", count)
        logits = batch.decode_step([5] * len(prompts))
    return logits, launched


def cast_apart(x: torch.Tensor, w: torch.Tensor, w_scale: torch.Tensor) -> torch.Tensor:
    """`fp8_linear_cast` as a cast launch, then the GEMM."""
    return fp8_gemm.fp8_linear_triton(*quantize_triton(x, FP8_UE8M0.value), w, w_scale, x.dtype)


def test_small_batches_cast_inside_their_gemms_with_the_same_logits(
    tiny_args: ModelArgs, monkeypatch: pytest.MonkeyPatch, tokens
) -> None:
    prompts = [tokens(9).tolist(), tokens(12).tolist()]
    fused, fused_launches = step(tiny_args, prompts)
    monkeypatch.setattr(kernels, "casts_in_gemm", lambda rows, backend: False)
    monkeypatch.setattr(fp8_gemm, "fp8_linear_cast_triton", cast_apart)
    apart, apart_launches = step(tiny_args, prompts)
    assert torch.equal(fused, apart)
    layers = tiny_args.num_hidden_layers
    # per layer at least wo_b's input (the sites', c^Q's and the shared W2's come with their producers)
    assert apart_launches["_quantize_kernel"] - fused_launches["_quantize_kernel"] >= layers
    assert fused_launches["_swiglu_cast_kernel"] == apart_launches["_swiglu_cast_kernel"] == layers
    assert fused_launches["_norm_cast_kernel"] == apart_launches["_norm_cast_kernel"] == 3 * layers
    assert fused_launches["_fp8_linear_kernel"] == apart_launches["_fp8_linear_kernel"]


def norm_then_cast(X: torch.Tensor, pre: torch.Tensor | None, weight: torch.Tensor, eps: float):
    """`kernels.norm_cast` as the torch norm, then the cast's own launch."""
    x, _, _ = act_cast.norm_cast_torch(X, pre, weight, eps)
    return x, *quantize_triton(x, FP8_UE8M0.value)


def test_sites_cast_in_their_norms_kernel_with_the_logits_of_the_cast_apart(
    tiny_args: ModelArgs, monkeypatch: pytest.MonkeyPatch, tokens
) -> None:
    prompts = [tokens(9).tolist(), tokens(12).tolist()]
    fused, fused_launches = step(tiny_args, prompts)
    monkeypatch.setattr(act_cast, "norm_cast_triton", norm_then_cast)
    apart, apart_launches = step(tiny_args, prompts)
    torch.testing.assert_close(fused, apart, rtol=1e-4, atol=1e-4)  # the norms' sums in another order
    sites, layers = fused_launches["_norm_cast_kernel"], tiny_args.num_hidden_layers
    assert sites == 3 * layers
    assert apart_launches["_norm_cast_kernel"] == 0
    assert apart_launches["_quantize_kernel"] - fused_launches["_quantize_kernel"] == sites


def test_sibling_linears_run_as_one_gemm(tiny_args: ModelArgs, monkeypatch: pytest.MonkeyPatch, tokens) -> None:
    """The packed model's FP8 siblings (attention's wq_a and wkv, the shared expert's w1 and w3, wq_b and the
    indexer's wq_b) are stacked views of one buffer and run as one GEMM each pair: two or three GEMM launches a layer
    fewer, the logits of one GEMM each (bit for bit here, where every GEMM is one K split; on a GPU the splits follow
    the grid's size)."""
    model = build_model(tiny_args, seed=0, dtype=torch.float32)
    indexed = [block.attn for block in model.layers if block.attn.role.owns_index_query]
    attn, shared = indexed[0], model.layers[0].ffn.shared_experts
    for first, second in ((attn.wq_a, attn.wkv), (shared.w1, shared.w3), (attn.wq_b, attn.indexer.wq_b)):
        assert second.weight.data_ptr() == first.weight.data_ptr() + first.weight.nbytes
    prompts = [tokens(9).tolist(), tokens(12).tolist()]
    together, together_launches = step(tiny_args, prompts)
    monkeypatch.setattr(linear, "_stacked", lambda linears: None)
    apart, apart_launches = step(tiny_args, prompts)
    assert torch.equal(together, apart)
    gemms = apart_launches["_fp8_linear_kernel"] - together_launches["_fp8_linear_kernel"]
    assert gemms == 2 * tiny_args.num_hidden_layers + len(indexed)
