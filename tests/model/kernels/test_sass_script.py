"""bench/sass.py compiles kernels for sm_90 without a GPU (Triton's own ptxas and cuobjdump): a change that breaks
the GPU compile — or moves the indexer's tile loop off the FP8 tensor cores — shows here, not on the next GPU call."""

import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[3]


def sass(*args: str) -> str:
    done = subprocess.run(
        [sys.executable, "bench/sass.py", *args], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, (done.stdout + done.stderr)[-3000:]
    return done.stdout


def test_the_indexer_decode_launch_compiles_onto_fp8_tensor_cores() -> None:
    report = sass("indexer")
    registers = int(re.search(r"4 warps, (\d+) registers", report).group(1))
    assert registers <= 128  # the decode cap: four programs per SM
    loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
    assert any("QGMMA" in loop for loop in loops), report  # FP8 E4M3 wgmma in a tile loop


def test_the_topk_kernels_compile() -> None:
    report = sass("topk", "--rows", "256", "--length", "65536")
    kernels = [line.split(":")[0] for line in report.splitlines() if not line.startswith(" ")]
    assert kernels == ["top-k group maxima", "top-k threshold", "top-k gather", "top-k select"], report


SHARED_PER_BLOCK = 232_448  # sm_90's most shared memory per program (227 KiB): a launch over it fails


def shared_bytes(head: str) -> int:
    return int(re.search(r"(\d+) B shared", head).group(1))


def test_the_fp8_gemm_compiles_onto_fp8_tensor_cores_below_32_tokens() -> None:
    report = sass("fp8-gemm", "--tokens", "16", "--top", "100")
    assert " 0 spill loads" in report, report
    loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
    assert any("QGMMA" in loop for loop in loops), report  # FP8 E4M3 wgmma in the K loop


def test_the_fp8_gemm_folds_the_scales_into_bf16_dots_from_32_tokens() -> None:
    for tokens in ("64", "256"):
        report = sass("fp8-gemm", "--tokens", tokens, "--top", "100")
        head = report.splitlines()[0]
        assert "bf16 dots" in head, report
        assert " 0 spill loads" in head, report
        assert shared_bytes(head) <= SHARED_PER_BLOCK, report
        loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
        assert any("HGMMA" in loop and "FFMA" not in loop for loop in loops), report  # no per-chunk rescale


def test_the_moe_gemms_compile_onto_bf16_tensor_cores_with_the_ptx_decode() -> None:
    report = sass("moe-gemm", "--tokens", "512", "--block", "16", "--top", "100")  # 64 pairs a tile: the most
    heads = [line for line in report.splitlines() if not line.startswith(" ")]
    assert [line.split(" 64 pairs")[0] for line in heads] == ["moe gate_up", "moe down"], report
    assert all(" 0 spill loads" in line for line in heads), report
    assert all(shared_bytes(line) <= SHARED_PER_BLOCK for line in heads), report
    loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
    assert sum("HGMMA" in loop and "PRMT" in loop for loop in loops) >= 2, report  # bf16 wgmma beside the lookups


def test_the_moe_gemms_fp8_chunks_compile_onto_fp8_tensor_cores() -> None:
    report = sass("moe-gemm", "--tokens", "256", "--dot", "fp8", "--top", "100")
    heads = [line for line in report.splitlines() if not line.startswith(" ")]
    assert [line.split(" 32 pairs")[0] for line in heads] == ["moe gate_up", "moe down"], report
    assert all(shared_bytes(line) <= SHARED_PER_BLOCK for line in heads), report
    loops = [line for line in report.splitlines() if line.startswith("  loop of ")]
    assert sum("QGMMA" in loop for loop in loops) >= 2, report  # FP8 E4M3 wgmma in the K loops


def test_the_step_glue_kernels_compile_without_spills_at_the_released_expert_count() -> None:
    """The mHC coefficients' kernels (the projection alone and with the update before it) and the MoE routing's
    compile for sm_90 without spills; the top-k keeps its rows' scores in registers at 384 experts (a spill there is
    paid once per MoE layer per step)."""
    report = sass("step-glue", "--experts", "384")
    heads = [line for line in report.splitlines() if not line.startswith(" ")]
    assert [head.split(":")[0] for head in heads] == [
        "mHC mix partials", "mHC mix partials of the update", "mHC coefficients", "MoE gate logits", "MoE top-k"
    ], report  # fmt: skip
    assert all(" 0 spill loads" in head for head in heads), report
