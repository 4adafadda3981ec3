"""Engram tables off the device (`host`: host memory, `mmap`: the checkpoint's shards mapped): the host hashes each
step's rows and gathers them on worker threads, or the device gathers them from pinned tables in place; every output
is bit-identical to the on-device table's, through chunked prefill, a restored prefix, decode steps, forks and
DSpark verify."""

from __future__ import annotations

import datetime
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from model import DecodeBatch, ModelArgs, SamplingParams, Transformer, build_model, encode_prefill
from model.checkpoint import Checkpoint, load_checkpoint, write_seeded
from model.engram_store import (
    EngramFetch,
    HostMemory,
    InPlaceMemory,
    available_host_bytes,
    cgroup_free_bytes,
    choose_placement,
    engram_tables,
)
from model.graphs import StepGraphs
from model.serving import Past
from model.shared_tables import SharedTables


@pytest.fixture(scope="module")
def on_host(tiny_args: ModelArgs) -> Transformer:
    return build_model(tiny_args, seed=0, dtype=torch.float64, engram="host")


@pytest.fixture(scope="module")
def checkpoint_dir(tiny_args: ModelArgs, tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("engram") / "tiny"
    write_seeded(out, tiny_args, seed=0, dtype=torch.float64, shard_bytes=1 << 20)
    return out


def run(model: Transformer, prompt: list[int], cut: int, static: bool = False) -> dict[str, object]:
    """Everything a request does that reads Engram rows: a prefill in chunks, a second prefill continuing the first's
    prefix, a decode batch (join, steps, a fork) and one DSpark draft + verify; the results, for bitwise checks.
    `static`: the batch runs the forwards its CUDA graphs would capture (model.graphs; uncaptured, rows padded to 4),
    host tables through the staged rows of each."""
    first = encode_prefill(model, prompt[:cut], chunk_tokens=5)
    whole = encode_prefill(model, prompt, Past(first.blocks, first.encoder_state), chunk_tokens=4)
    batch = DecodeBatch(model)
    if static:
        batch.graphs = StepGraphs(model, batch.cache, buckets=(4,), capture=False)
    seq, logits = batch.join(whole.blocks, whole.encoder_state)
    out = {"blocks": whole.blocks, "state": whole.encoder_state, "join": logits}
    steps = [batch.decode_step([t]) for t in (5, 17)]
    batch.fork(seq)
    steps.append(batch.decode_step([3, 4]))
    greedy = SamplingParams.uniform(2)
    draft = batch.dspark_draft([8, 9], greedy)
    result = batch.verify([8, 9], draft, greedy)
    if static:  # host tables: every forward but the draft read staged rows, gathered in place or by the host
        widths = [(4, 1), (4, 1 + model.args.dspark_block_size)]
        assert sorted(batch.graphs.staged) == (widths if model.engram_fetch else [])
        in_place = model.engram_fetch is not None and model.engram_fetch.in_place()
        assert all(s.in_place == in_place and not (in_place and s.host) for s in batch.graphs.staged.values())
    if batch.cache.host_history is not None:  # the host's mirror of the look-back followed every step
        assert torch.equal(batch.cache.host_history[:2], batch.cache.history[:2])
    return out | {"steps": steps, "verify": (result.tokens, result.logits), "history": batch.cache.history.clone()}


def assert_same(a: object, b: object) -> None:
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype
        assert torch.equal(a, b)
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for key in a:
            assert_same(a[key], b[key])
    elif hasattr(a, "__dataclass_fields__"):
        assert_same(vars(a), vars(b))
    else:
        assert a == b


def test_host_tables_give_the_device_tables_outputs_bit_for_bit(tiny: Transformer, on_host: Transformer, tokens):
    prompt = tokens(23).tolist()
    assert all(t.weight.device.type == "cpu" for t in engram_tables(on_host).values())
    assert on_host.engram_fetch is not None
    assert tiny.engram_fetch is None
    assert_same(run(on_host, prompt, cut=13), run(tiny, prompt, cut=13))


def test_staged_host_rows_of_static_forwards_give_the_device_tables_outputs_bit_for_bit(
    tiny: Transformer, on_host: Transformer, tokens
):
    """What a captured forward does with host tables — the host stages the padded rows' ids in fixed buffers before
    the forward, the forward reads them there — gives the device tables' outputs, bit for bit."""
    prompt = tokens(19).tolist()
    assert_same(run(on_host, prompt, cut=7, static=True), run(tiny, prompt, cut=7, static=True))


@pytest.mark.parametrize("static", [False, True], ids=["eager", "static"])
def test_rows_gathered_in_place_give_the_device_tables_outputs_bit_for_bit(
    tiny: Transformer, tiny_args: ModelArgs, tokens, static: bool
):
    """What a GPU forward does with tables in pinned host memory — eager (a prefill chunk) or as its CUDA graph
    would capture it — hashes its own tokens on the model's device and gathers their rows from the tables where they
    lie, the host hashing and staging nothing (the cache keeps no host look-back), and gives the device tables'
    outputs, bit for bit."""
    model = build_model(tiny_args, seed=0, dtype=torch.float64, engram="host")
    model.engram_fetch.close()
    model.engram_fetch = EngramFetch(model, gather_on_device=True)
    prompt = tokens(19).tolist()
    try:
        batch, out = DecodeBatch(model), encode_prefill(model, prompt[:9])
        batch.join(out.blocks, out.encoder_state)
        assert batch.cache.host_history is None
        assert isinstance(model.engram_memory(batch.cache.step(torch.tensor([[7]]))), InPlaceMemory)
        assert_same(run(model, prompt, cut=7, static=static), run(tiny, prompt, cut=7, static=static))
    finally:
        model.engram_fetch.close()


def test_a_host_step_fetches_its_rows_on_the_host_and_mirrors_the_look_back(on_host: Transformer, tokens) -> None:
    batch = DecodeBatch(on_host)
    out = encode_prefill(on_host, tokens(9).tolist())
    batch.join(out.blocks, out.encoder_state)
    step = batch.cache.step(torch.tensor([[7]]))
    memory = on_host.engram_memory(step)
    assert isinstance(memory, HostMemory)
    host_tokens, host_history = step.host_ids()
    assert torch.equal(host_history, batch.cache.history[:1])
    assert host_tokens.tolist() == [[7]]
    layer = on_host.args.engram_layer_ids[0]
    expected = on_host.layers[layer].engram.embed(on_host.engram_rows(step.tokens, step.history)[layer])
    assert torch.equal(memory.values(layer), expected)


def test_mapped_tables_are_the_shard_files_pages_and_give_the_same_outputs(checkpoint_dir: Path, tokens) -> None:
    mapped = load_checkpoint(checkpoint_dir, dtype=torch.float64, engram="mmap")
    on_device = load_checkpoint(checkpoint_dir, dtype=torch.float64)
    shards = {str(p.resolve()) for p in checkpoint_dir.glob("*.safetensors")}
    regions = [line.split() for line in Path("/proc/self/maps").read_text().splitlines()]
    regions = [tuple(int(x, 16) for x in r[0].split("-")) for r in regions if len(r) >= 6 and r[5] in shards]
    for table in engram_tables(mapped).values():
        for t in (table.weight, table.scale):
            assert any(lo <= t.data_ptr() < hi for lo, hi in regions), "an Engram table was copied, not mapped"
    assert mapped.load_report.read_bytes < Checkpoint(checkpoint_dir).nbytes  # the tables were not read
    prompt = tokens(15).tolist()
    assert_same(run(mapped, prompt, cut=6), run(on_device, prompt, cut=6))


def test_ranks_sharing_host_tables_map_one_file_which_only_its_owner_reads(checkpoint_dir: Path, tokens) -> None:
    """Two ranks of a node, as `model_service.ranks` makes them: the owner sizes the node's table file and reads the
    tables into it, the other maps the same pages and reads none of the tables; both give the device tables' outputs.
    A rank whose tables do not fit the announced file is refused."""
    fd, store, wait = SharedTables.create(), dist.HashStore(), datetime.timedelta(seconds=10)

    def shared(owner: bool) -> SharedTables:
        return SharedTables(fd, owner, store, node=0, timeout=wait)

    try:
        ranks = [load_checkpoint(checkpoint_dir, dtype=torch.float64, engram="host", shared=shared(o)) for o in (1, 0)]
        maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if "/memfd:" in line]
        regions = [[int(x, 16) for x in m[0].split("-")] for m in maps if m[4] == str(os.fstat(fd).st_ino)]
        for model in ranks:
            for t in (t for table in engram_tables(model).values() for t in (table.weight, table.scale)):
                assert any(lo <= t.data_ptr() < hi for lo, hi in regions), "an Engram table is not in the shared file"
        owner, follower = (m.load_report.read_bytes for m in ranks)
        assert owner - follower == sum(table_bytes(table) for table in engram_tables(ranks[0]).values())
        prompt = tokens(15).tolist()
        expected = run(load_checkpoint(checkpoint_dir, dtype=torch.float64), prompt, cut=6)
        for model in ranks:
            assert_same(run(model, prompt, cut=6), expected)
        wider = Checkpoint(checkpoint_dir).args.replace(engram_head_dim=64)
        with pytest.raises(RuntimeError, match="the node's Engram table file holds"):
            build_model(wider, seed=0, dtype=torch.float64, engram="host", shared=shared(False))
    finally:
        os.close(fd)


def table_bytes(table: torch.nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in table.state_dict().values())


def test_placement_choices_and_refusals(tiny_args: ModelArgs) -> None:
    cpu, gpu = torch.device("cpu"), torch.device("cuda")
    assert choose_placement("auto", 1 << 40, cpu, checkpoint=True) == "device"
    assert choose_placement("auto", 1 << 20, gpu, checkpoint=True) == "host"
    assert choose_placement("auto", 1 << 60, gpu, checkpoint=True) == "mmap"  # more than any host holds
    assert choose_placement("host", 1 << 60, gpu, checkpoint=False) == "host"
    with pytest.raises(ValueError, match="needs a checkpoint directory"):
        choose_placement("mmap", 1, gpu, checkpoint=False)
    with pytest.raises(ValueError, match="must be one of auto, device, host, mmap"):
        choose_placement("ssd", 1, gpu, checkpoint=True)
    with pytest.raises(ValueError, match="a seeded model has none"):
        build_model(tiny_args, seed=0, engram="mmap")


def test_free_host_memory_is_bounded_by_the_memory_cgroup_and_its_ancestors(tmp_path: Path) -> None:
    """A container's memory limit (cgroup v2 or v1, set on it or on its pod above it) bounds what `auto` may place
    on the host; no limit (v2's "max", v1's largest int64) leaves the host's free memory."""
    gib = 1 << 30

    def cgroup(path: str, **files: int | str) -> None:
        (tmp_path / path).mkdir(parents=True, exist_ok=True)
        for name, value in files.items():
            (tmp_path / path / name.replace("_", ".", 1)).write_text(f"{value}\n")

    membership = tmp_path / "cgroup"
    cgroup("kubepods/pod/ctr", memory_max=8 * gib, memory_current=1 * gib)
    cgroup("kubepods/pod", memory_max=4 * gib, memory_current=3 * gib)  # the pod's limit leaves less
    cgroup("kubepods", memory_max="max", memory_current=50 * gib)
    membership.write_text("0::/kubepods/pod/ctr\n")
    assert cgroup_free_bytes(tmp_path, membership) == 1 * gib
    assert available_host_bytes(tmp_path, membership) == 1 * gib
    cgroup("memory/a/b", memory_limit_in_bytes=9223372036854771712, memory_usage_in_bytes=gib)
    cgroup("memory/a", memory_limit_in_bytes=2 * gib, memory_usage_in_bytes=gib // 2)
    membership.write_text("5:cpu,cpuacct:/x\n4:memory:/a/b\n")
    assert cgroup_free_bytes(tmp_path, membership) == 3 * gib // 2
    membership.write_text("4:memory:/a/b\n")
    (tmp_path / "memory/a/memory.limit_in_bytes").write_text("9223372036854771712\n")
    assert cgroup_free_bytes(tmp_path, membership) is None
    assert cgroup_free_bytes(tmp_path, tmp_path / "missing") is None


def test_a_mapped_table_of_the_wrong_dtype_is_refused_by_name(checkpoint_dir: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    broken = tmp_path / "broken"
    broken.mkdir()
    for f in checkpoint_dir.iterdir():
        if f.suffix != ".safetensors":
            (broken / f.name).write_bytes(f.read_bytes())
            continue
        tensors = load_file(f)
        name = next((n for n in tensors if n.endswith("engram.embed.weight")), None)
        if name is not None:
            tensors[name] = tensors[name].view(torch.uint8).to(torch.bfloat16)
        save_file(tensors, broken / f.name, metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"engram\.embed\.weight: checkpoint dtype bfloat16, expected float8_e4m3fn"):
        load_checkpoint(broken, dtype=torch.float64, engram="mmap")


def test_the_fetcher_gathers_big_steps_in_pieces_with_the_same_rows(on_host: Transformer, tokens) -> None:
    history = torch.full((2, on_host.ngram.history_len), -1, dtype=torch.int64)
    ids = torch.stack([tokens(11), tokens(11)])
    whole, split = EngramFetch(on_host), EngramFetch(on_host, gather_threads=3, gather_rows=7)
    try:
        a, b = whole.start(ids, history), split.start(ids, history)
        for layer in on_host.args.engram_layer_ids:
            assert torch.equal(a.values(layer), b.values(layer))
    finally:
        whole.close()
        split.close()


def test_a_step_given_up_after_its_first_engram_layer_leaves_the_next_steps_rows_intact(
    on_host: Transformer, tokens
) -> None:
    """A big step queues every layer's gather at its first Engram layer and finishes each at its own layer: one
    abandoned in between (a failed forward) must not write into the rows of the step after it."""
    history = torch.full((2, on_host.ngram.history_len), -1, dtype=torch.int64)
    first, later = on_host.args.engram_layer_ids[0], on_host.args.engram_layer_ids[1:]
    given_up, step = torch.stack([tokens(13), tokens(13)]), torch.stack([tokens(11), tokens(11)]).flip(1)
    fetch = EngramFetch(on_host, gather_threads=3, gather_rows=5)
    try:
        fetch.start(given_up, history).values(first)
        memory = fetch.start(step, history)
        rows = on_host.engram_rows(step, history)
        for layer in (*later, first):
            assert torch.equal(memory.values(layer), on_host.layers[layer].engram.embed(rows[layer]))
    finally:
        fetch.close()
