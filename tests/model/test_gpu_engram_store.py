"""On a GPU (skipped without one): Engram tables in pinned host memory hold zero bytes on the device, and a model
fetching its rows from them gives the on-device tables' outputs bit for bit through prefill, decode and DSpark
verify, eagerly and replayed from CUDA graphs: hashed on the device and gathered from the mapped host tables as the
forward's first work (inside the graph for a replay), or, as for tables the GPU cannot read (`graphs-staged`, whose
prefill is eager), hashed and gathered by the host and copied on a side stream (staged before each replay)."""

from __future__ import annotations

import pytest
import torch

from model import DecodeBatch, SamplingParams, build_model, encode_prefill, preset
from model.engram_store import EngramFetch, engram_tables
from model.weights import weight_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def outputs(model, prompt: list[int], graphs: bool) -> list[torch.Tensor]:
    out = encode_prefill(model, prompt, chunk_tokens=16)
    batch = DecodeBatch(model, graphs=graphs)
    assert (batch.graphs is not None) == graphs
    seq, first = batch.join(out.blocks, out.encoder_state)
    batch.fork(seq)
    results = [first, out.encoder_state.hidden]
    for tokens in ([5, 6], [7, 8], [9, 10]):
        results.append(batch.decode_step(tokens))
    greedy = SamplingParams.uniform(2)
    draft = batch.dspark_draft([11, 12], greedy)
    results.append(batch.verify([11, 12], draft, greedy).logits)
    if graphs and model.engram_fetch is not None:
        assert {s.in_place for s in batch.graphs.staged.values()} == {model.engram_fetch.in_place()}
    return [r.float().cpu() for r in results]


@pytest.mark.parametrize("mode", ["eager", "graphs", "graphs-staged"])
@pytest.mark.parametrize("name", ["tiny", "small"])
def test_host_tables_hold_nothing_on_the_gpu_and_change_no_output(name: str, mode: str) -> None:
    args = preset(name)
    on_device = build_model(args, seed=0, device="cuda", dtype=torch.bfloat16)
    on_host = build_model(args, seed=0, device="cuda", dtype=torch.bfloat16, engram="host")
    assert on_host.engram_fetch.in_place()
    if mode == "graphs-staged":
        on_host.engram_fetch.close()
        on_host.engram_fetch = EngramFetch(on_host, gather_on_device=False)
    graphs = mode != "eager"
    tables = engram_tables(on_host).values()
    assert all(t.weight.device.type == "cpu" and t.weight.is_pinned() for t in tables)
    table_bytes = sum(weight_bytes(t) for t in tables)
    assert weight_bytes(on_host, on_host.device) == weight_bytes(on_device, on_device.device) - table_bytes
    prompt = torch.randint(0, args.vocab_size, (45,), generator=torch.Generator().manual_seed(1)).tolist()
    for got, want in zip(outputs(on_host, prompt, graphs), outputs(on_device, prompt, graphs), strict=True):
        assert torch.equal(got, want)


def test_a_big_steps_pieces_reach_the_gpu_intact_after_a_step_given_up_midway() -> None:
    """A prefill-sized step is gathered in pieces into reused pinned staging and copied piece by piece; one given up
    after its first Engram layer (its later layers' pieces still queued) must not write into the next step's rows."""
    args = preset("small")
    on_host = build_model(args, seed=0, device="cuda", dtype=torch.bfloat16, engram="host")
    fetch = EngramFetch(on_host, gather_threads=3, gather_rows=64)
    g = torch.Generator().manual_seed(2)
    given_up, step = (torch.randint(0, args.vocab_size, (4, 300), generator=g) for _ in range(2))
    history = torch.full((4, args.engram_max_ngram_size - 1), -1, dtype=torch.int64)
    tables = engram_tables(on_host)
    try:
        fetch.start(given_up, history).values(args.engram_layer_ids[0])
        memory = fetch.start(step, history)
        ids = fetch.hash.host_rows(step.numpy(), history.numpy())
        for layer in reversed(args.engram_layer_ids):
            want = tables[layer](torch.from_numpy(ids[layer]))
            assert torch.equal(memory.values(layer).cpu(), want.view(*ids[layer].shape, -1))
    finally:
        fetch.close()
