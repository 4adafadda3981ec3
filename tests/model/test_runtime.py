"""`model_service.runtime.load_model`: the model a service serves is in eval mode and frozen, so a forward outside
`no_grad` (a graph captured at start-up, a bench) still runs the kernels and not their autograd forms."""

from model_service.runtime import load_model


def test_a_served_model_asks_for_no_gradient() -> None:
    model = load_model("tiny", "full", device="cpu")
    assert not model.training
    assert not any(p.requires_grad for p in model.parameters())
