"""Programmatic dependent launch (model.kernels.launch): a kernel launched as a dependent must wait for its
predecessor before it reads or writes anything — one that did not would race it on the GPU, silently. Every Triton
kernel of model/kernels is launched so there, which these tests hold to: each kernel's first statement is the wait,
each launch passes the launch options."""

import ast
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from model.kernels.launch import dependent, dependent_launch, plain_launches

KERNELS = Path(__file__).resolve().parents[3] / "model" / "kernels"


def _modules() -> Iterator[tuple[str, ast.Module]]:
    for path in sorted(KERNELS.glob("*.py")):
        yield path.name, ast.parse(path.read_text())


def _jitted(module: ast.Module) -> Iterator[ast.FunctionDef]:
    for node in module.body:
        if isinstance(node, ast.FunctionDef) and any("triton.jit" in ast.unparse(d) for d in node.decorator_list):
            yield node


def _launch(node: ast.AST) -> bool:
    """`name_kernel[grid](…)`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Subscript)
        and ast.unparse(node.func.value).endswith("_kernel")
    )


KERNEL_DEFS = {
    f"{name}:{fn.name}": fn for name, module in _modules() for fn in _jitted(module) if fn.name.endswith("_kernel")
}
LAUNCHES = {f"{name}:{node.lineno}": node for name, module in _modules() for node in ast.walk(module) if _launch(node)}


def test_the_kernels_and_their_launches_are_found() -> None:
    assert len(KERNEL_DEFS) >= 20
    assert len(LAUNCHES) >= 20


@pytest.mark.parametrize("where", KERNEL_DEFS)
def test_every_kernel_waits_for_its_predecessor_first(where: str) -> None:
    fn = KERNEL_DEFS[where]
    assert [a.arg for a in fn.args.args][-2:] == ["PDL", "EARLY"]
    body = fn.body[1:] if isinstance(fn.body[0], ast.Expr) and isinstance(fn.body[0].value, ast.Constant) else fn.body
    assert ast.unparse(body[0]) == "follow(PDL, EARLY)"


@pytest.mark.parametrize("where", LAUNCHES)
def test_every_launch_takes_the_dependent_launch_options(where: str) -> None:
    spread = [ast.unparse(k.value) for k in LAUNCHES[where].keywords if k.arg is None]
    assert any(s.startswith("dependent_launch(") for s in spread)


def test_a_cpu_launches_plainly() -> None:
    assert dependent_launch(torch.device("cpu"), (1,)) == {"PDL": False, "EARLY": False, "launch_pdl": False}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_plain_launches_turn_dependent_launches_off_inside_and_back_after() -> None:
    device = torch.device("cuda")
    before = dependent(device)
    with plain_launches():
        assert not dependent(device)
        with plain_launches():
            assert not dependent(device)
        assert not dependent(device)
    assert dependent(device) == before
