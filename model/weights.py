"""Weights: the two forms of a model, deterministic initialisation, and the checkpoint tensors a model holds.

Checkpoint tensors carry the released names (reference §2.9): the module paths (`layers.3.attn.wq_a.weight`,
`mtp.2.markov_head.embed.weight`, …). With a `quantization_config` they are stored as released:

| weight format | stored tensors                                                                                   |
|---------------|--------------------------------------------------------------------------------------------------|
| fp8           | `X.weight` E4M3 (F8_E4M3) [out, in]; `X.scale` UE8M0 (F8_E8M0) [⌈out/32⌉, ⌈in/32⌉]                  |
| fp4 (experts) | `X.weight` packed E2M1 (F4, low nibble = even input) [out, in/2]; `X.scale` UE8M0 [out, in/32 or 16] |
| Engram table  | `engram.embed.weight` E4M3 [rows, head_dim]; `engram.embed.scale` UE8M0 [rows, head_dim/32]        |
| others        | plain, in the model's dtype (fp32 parameters stay fp32)                                          |

Scales and nibbles are read as bytes whatever their stored dtype (U8 is read too). Without a quantization_config
every tensor is plain.

A model is built in one of two forms (`model.linear`): **packed** (serving: quantised weights keep exactly the
checkpoint bytes above, so the weight memory equals the checkpoint's) or **float** (training and exactness tests:
every weight a float holding the value its stored form decodes to). `store` fills either form from checkpoint
tensors — a file's (`model.checkpoint`) or the seeded ones of `seeded_tensors` — checking each tensor's name, dtype
and shape; `state_tensors` gives them back. Seeded weights are generated per tensor name on the model's device, so
a prefill machine (encoder part) and a decode machine (full model) of one seed hold the same weights.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Callable, Iterable, Iterator, Mapping

import torch
from torch import Tensor, nn

from model import quant
from model.config import ModelArgs
from model.dspark import ConfidenceHead
from model.engram_store import Placement, engram_tables, place_tables
from model.linear import Embedding, Fp8Linear, Fp8Rows, Linear, stack
from model.moe import Experts, PackedExperts
from model.norm import RMSNorm
from model.parallel import SINGLE, Parallel
from model.shared_tables import SharedTables
from model.transformer import Part, Transformer

_BLOCK = 32  # FP8 weight blocks are 32×32 (quantization_config.weight_block_size)
_ROWS_CHUNK = 1 << 22  # values an 'fp8_rows' table quantises at a time: its fp32 temporaries stay at 16 MiB each
BYTE_DTYPES = {  # the stored dtypes of packed bytes, as released
    "fp8": torch.float8_e4m3fn,
    "scale": torch.float8_e8m0fnu,
    "fp4": torch.float4_e2m1fn_x2,
}
PLAIN_DTYPES = (torch.bfloat16, torch.float16, torch.float32, torch.float64)


# --------------------------------------------------------------------------------------------- formats
def _formats(model: nn.Module) -> dict[str, str]:
    """Float form: parameter name → storage format of its quantised weights ('fp8', 'fp4', 'fp8_rows')."""
    fmt: dict[str, str] = {}
    quantized = model.args.quantization_config is not None
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.quantized:
            fmt[f"{name}.weight"] = module.fmt
        elif isinstance(module, Embedding) and name.endswith("engram.embed") and quantized:
            fmt[f"{name}.weight"] = "fp8_rows"
    return fmt


def _blocks_2d(w: Tensor) -> tuple[Tensor, tuple[int, int]]:
    """[O, I] → [⌈O/32⌉, ⌈I/32⌉, 1024] (zero-padded: zeros never raise a block's amax)."""
    O, I = w.shape
    padded = torch.nn.functional.pad(w.float(), (0, -I % _BLOCK, 0, -O % _BLOCK))
    o, i = padded.shape[0] // _BLOCK, padded.shape[1] // _BLOCK
    return padded.view(o, _BLOCK, i, _BLOCK).permute(0, 2, 1, 3).reshape(o, i, _BLOCK * _BLOCK), (O, I)


def _unblock_2d(blocks: Tensor, shape: tuple[int, int]) -> Tensor:
    o, i, _ = blocks.shape
    return blocks.view(o, i, _BLOCK, _BLOCK).permute(0, 2, 1, 3).reshape(o * _BLOCK, i * _BLOCK)[: shape[0], : shape[1]]


def quantize_weight(w: Tensor, fmt: str, block: int = _BLOCK) -> tuple[Tensor, Tensor]:
    """A float weight → its stored (data, scale) pair (`block`: the FP4 scale block, 32 or 16)."""
    if fmt == "fp8":
        blocks, shape = _blocks_2d(w)
        data, scale = quant.fp8_quant(blocks, block=_BLOCK * _BLOCK)
        return _unblock_2d(data, shape).view(torch.float8_e4m3fn), scale.squeeze(-1)
    if fmt == "fp4":
        return quant.fp4_quant_ue8m0(w, block=block)
    if fmt == "fp8_rows":
        data, scale = _fp8_rows(w)
        return data.view(torch.float8_e4m3fn), scale
    raise ValueError(f"unknown weight format {fmt!r}")


def _fp8_rows(w: Tensor) -> tuple[Tensor, Tensor]:
    """`quant.fp8_quant` of a table [rows, D], a few million values at a time: an Engram table holds up to hundreds of
    millions of rows, whose fp32 temporaries at once would outgrow the table itself many times over. Rows quantise
    alone, so the result is the whole table's."""
    rows = max(1, _ROWS_CHUNK // max(1, w.shape[-1]))
    if w.shape[0] <= rows:
        return quant.fp8_quant(w, block=_BLOCK)
    data = torch.empty(w.shape, dtype=torch.uint8, device=w.device)
    scale = torch.empty((*w.shape[:-1], w.shape[-1] // _BLOCK), dtype=torch.uint8, device=w.device)
    for lo in range(0, w.shape[0], rows):
        data[lo : lo + rows], scale[lo : lo + rows] = quant.fp8_quant(w[lo : lo + rows], block=_BLOCK)
    return data, scale


def dequantize_weight(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    data, scale = data.view(torch.uint8), scale.view(torch.uint8)
    if fmt == "fp8":
        O, I = data.shape
        blocks, _ = _blocks_2d(quant.e4m3_decode(data))
        values = blocks * quant.ue8m0_decode(scale).unsqueeze(-1)
        return _unblock_2d(values, (O, I)).to(dtype)
    if fmt == "fp4":
        return quant.fp4_dequant_ue8m0(data, scale, block=2 * data.shape[-1] // scale.shape[-1], dtype=dtype)
    if fmt == "fp8_rows":
        return quant.fp8_dequant(data, scale, block=_BLOCK, dtype=dtype)
    raise ValueError(f"unknown weight format {fmt!r}")


def scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


# ---------------------------------------------------------------------------------------------- packing
def _packed_twin(name: str, module: nn.Module, model: Transformer, device: torch.device) -> nn.Module | None:
    """The packed form of a float-form module holding quantised weights (None: the module has none)."""
    q = model.args.quantization_config
    if q is None:
        return None
    if isinstance(module, Linear) and module.fmt == "fp8":
        return Fp8Linear(module.in_features, module.out_features, device)
    if isinstance(module, Experts):
        w1 = module[0].w1
        return PackedExperts(
            len(module), w1.in_features, w1.out_features, module[0].limit, q.expert_scale_block, device, module.first
        )
    if isinstance(module, Embedding) and name.endswith("engram.embed"):
        return Fp8Rows(*module.weight.shape, model.dtype, "meta")  # allocated where it is placed (`pack`)
    return None


def pack(
    model: Transformer, device: torch.device, engram: Placement = "device", shared: SharedTables | None = None
) -> Transformer:
    """A float-form model built on `meta` → the packed form on `device`, uninitialised: quantised weights become
    their checkpoint bytes, everything else is allocated as it is (never a float copy of a quantised weight). The
    Engram tables go where `engram` (and `shared`) place them (`place_engram_tables`), never to the device first."""
    for name, module in list(model.named_modules()):
        twin = _packed_twin(name, module, model, device)
        if twin is not None:
            parent, _, leaf = name.rpartition(".")
            setattr(model.get_submodule(parent), leaf, twin)
    place_engram_tables(model, engram, device, shared)
    mapped = {id(t) for t in engram_tables(model).values()} if engram == "mmap" else set()  # left for the loader
    for module in model.modules():
        if id(module) in mapped:
            continue
        for key, p in module.named_parameters(recurse=False):
            if p.is_meta:
                setattr(module, key, nn.Parameter(torch.empty_like(p, device=device), p.requires_grad))
        for key, b in module.named_buffers(recurse=False):
            setattr(module, key, torch.empty_like(b, device=device) if b.is_meta else b.to(device))
        for group in getattr(module, "SIBLINGS", ()):  # FP8 linears of one input: one GEMM (`project_together`)
            linears = [_submodule(module, name) for name in group]
            if all(isinstance(lin, Fp8Linear) for lin in linears):
                stack(linears)
    return model


def _submodule(module: nn.Module, name: str) -> nn.Module | None:
    """module's submodule at the dotted `name`, None where it has none."""
    try:
        return module.get_submodule(name)
    except AttributeError:
        return None


def place_engram_tables(
    model: Transformer, placement: Placement, device: torch.device, shared: SharedTables | None = None
) -> None:
    """Move the Engram tables' storage off the device, uninitialised: into host memory for `host` (page-locked when
    the model is on a GPU, which then copies rows from it asynchronously; in the node's shared table file when
    `shared` is given), onto `meta` for `mmap` (the loader maps the checkpoint's shards there). `device`: nothing
    moves."""
    if placement == "device":
        return
    if placement == "mmap" and not any(isinstance(m, Fp8Rows) for m in model.modules()):
        raise ValueError("--engram-store mmap maps FP8 tables: it needs a quantised model in its packed form")
    where = torch.device("meta" if placement == "mmap" else "cpu")
    pin = placement == "host" and device.type == "cuda"
    tables = engram_tables(model).values()
    slots = [(table, key, p) for table in tables for key, p in table.named_parameters(recurse=False)]
    if placement == "host" and shared is not None:
        storages = shared.tensors([(p.shape, p.dtype) for _, _, p in slots], pin)
    else:
        storages = [torch.empty(p.shape, dtype=p.dtype, device=where, pin_memory=pin) for _, _, p in slots]
    for (table, key, _), storage in zip(slots, storages, strict=True):
        setattr(table, key, nn.Parameter(storage, requires_grad=False))


def engram_table_names(model: Transformer) -> list[str]:
    """Checkpoint names of the model's Engram tables (weights and scales)."""
    return [name for name in checkpoint_views(model) if ".engram.embed." in name]


def filled_elsewhere(model: Transformer, engram: Placement, shared: SharedTables | None) -> list[str]:
    """Checkpoint names of the tensors another rank fills for this one: the Engram tables of a node's shared table
    file, where this rank does not own it."""
    return engram_table_names(model) if engram == "host" and shared is not None and not shared.owner else []


def is_packed(model: nn.Module) -> bool:
    return any(isinstance(m, (Fp8Linear, PackedExperts, Fp8Rows)) for m in model.modules())


# ----------------------------------------------------------------------------------- checkpoint tensors
def checkpoint_views(model: nn.Module) -> dict[str, Tensor]:
    """Packed form: checkpoint name → the model tensor holding it (experts: views of the stacked storage)."""
    views = dict(model.state_dict(keep_vars=True))
    for name, module in model.named_modules():
        if isinstance(module, PackedExperts):
            views = {k: v for k, v in views.items() if not k.startswith(f"{name}.")}
            views |= module.checkpoint_views(f"{name}.")
    return views


def weight_bytes(model: nn.Module, device: torch.device | None = None) -> int:
    """Bytes of the model's persistent state (what a checkpoint of it stores); `device`: of what lives there only
    (the Engram tables may be in host memory or mapped from the checkpoint)."""
    state = model.state_dict().values()
    return sum(t.numel() * t.element_size() for t in state if device is None or t.device == device)


def stored_form(name: str, t: Tensor) -> Tensor:
    """A packed model tensor in the dtype the released files store it in (bytes are reinterpreted, never converted)."""
    if t.dtype != torch.uint8:
        return t
    return t.view(BYTE_DTYPES["scale" if name.endswith(".scale") else "fp4"])


def state_tensors(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's (name, tensor) pairs of a model, either form: quantised weights as data + `.scale`."""
    if is_packed(model):
        for name, t in checkpoint_views(model).items():
            yield name, stored_form(name, t.detach())
        return
    formats = _formats(model)
    for name, p in model.state_dict().items():
        if name in formats:
            data, scale = quantize_weight(p.detach(), formats[name])
            yield name, data
            yield scale_name(name), stored_form(scale_name(name), scale)
        else:
            yield name, p.detach()


def _check_dtype(name: str, value: Tensor, held_as: torch.dtype) -> None:
    """ValueError unless `value` is stored in a dtype that a tensor held as `held_as` takes: bytes (scales, E2M1
    nibbles) as U8 or their released dtype, E4M3 as E4M3, a plain tensor as any float (never an FP8 one)."""
    if held_as == torch.uint8:
        accepted = (torch.uint8, BYTE_DTYPES["scale" if name.endswith(".scale") else "fp4"])
    else:
        accepted = PLAIN_DTYPES if held_as in PLAIN_DTYPES else (held_as,)
    if value.dtype not in accepted:
        wanted = " or ".join(str(d).removeprefix("torch.") for d in accepted)
        raise ValueError(f"{name}: checkpoint dtype {str(value.dtype).removeprefix('torch.')}, expected {wanted}")


def _check_shape(name: str, shape: torch.Size, target: Tensor) -> None:
    if tuple(shape) != tuple(target.shape):
        raise ValueError(f"{name}: checkpoint shape {tuple(shape)} != model shape {tuple(target.shape)}")


def _assign(target: Tensor, value: Tensor) -> None:
    if target.dtype in PLAIN_DTYPES:
        target.copy_(value.to(target.dtype))
    else:
        target.copy_(value.view(target.dtype))  # bytes as bytes, whatever dtype they were stored as


class _Targets:
    """Where each checkpoint tensor of a model goes: a packed model takes the bytes as they are; the float form
    decodes each quantised weight once both its halves (`.weight`, `.scale`) have come."""

    def __init__(self, model: Transformer) -> None:
        self.packed = is_packed(model)
        self.formats = {} if self.packed else _formats(model)
        self.targets = checkpoint_views(model) if self.packed else dict(model.state_dict(keep_vars=True))
        self.expected = set(self.targets) | {scale_name(n) for n in self.formats}
        self.held: dict[str, Tensor] = {}

    def put(self, name: str, value: Tensor) -> None:
        weight = name.removesuffix(".scale") + ".weight" if name.endswith(".scale") else name
        if weight not in self.formats:
            target = self.targets[name]
            _check_dtype(name, value, target.dtype)
            _check_shape(name, value.shape, target)
            _assign(target, value)
            return
        fmt, target = self.formats[weight], self.targets[weight]
        held_as = torch.uint8 if name != weight or fmt == "fp4" else torch.float8_e4m3fn  # as the packed form has it
        _check_dtype(name, value, held_as)
        self.held[name] = value
        if weight in self.held and scale_name(weight) in self.held:
            data, scale = self.held.pop(weight), self.held.pop(scale_name(weight))
            try:
                decoded = dequantize_weight(data, scale, fmt, target.dtype)
            except (ValueError, RuntimeError) as exc:
                raise ValueError(f"{weight}: {exc}") from exc
            _check_shape(weight, decoded.shape, target)
            target.copy_(decoded)


def expected_names(model: Transformer) -> set[str]:
    """The checkpoint tensors a model part holds (and the optional calibrations)."""
    return _Targets(model).expected


@torch.no_grad()
def store(model: Transformer, tensors: Iterable[tuple[str, Tensor]], source: str, skip: Iterable[str] = ()) -> int:
    """Fill `model` (either form) from checkpoint (name, tensor) pairs and return the bytes stored. Tensors the model
    does not hold are skipped; one it holds with the wrong dtype or shape is a ValueError naming it, and so is a
    missing one — except the DSpark confidence temperatures (a calibration: absent, they are 1) and the `skip` ones
    (filled otherwise: `map_tensor`)."""
    targets = _Targets(model)
    seen, stored = set(skip), 0
    for name, value in tensors:
        if name in targets.expected:
            targets.put(name, value)
            seen.add(name)
            stored += value.numel() * value.element_size()
    calibrations = {f"{n}.temperature": m for n, m in model.named_modules() if isinstance(m, ConfidenceHead)}
    missing = sorted(targets.expected - seen - set(calibrations))
    if missing:
        raise ValueError(f"{source} lacks {len(missing)} tensors of this model, e.g. {missing[:3]}")
    for name, head in calibrations.items():
        if name not in seen:
            head.temperature.fill_(1.0)
        head.check()
    return stored


def map_tensor(model: Transformer, name: str, value: Tensor | None, source: str) -> None:
    """Make a packed model's tensor `name` the given storage itself (a memory-mapped checkpoint tensor), checked as
    `store` checks a copied one; None: the checkpoint lacks it (a ValueError naming it)."""
    if value is None:
        raise ValueError(f"{source} lacks {name}")
    module_name, _, key = name.rpartition(".")
    target = getattr(model.get_submodule(module_name), key)
    _check_dtype(name, value, target.dtype)
    _check_shape(name, value.shape, target)
    held = value if value.dtype == target.dtype else value.view(target.dtype)
    setattr(model.get_submodule(module_name), key, nn.Parameter(held, requires_grad=False))


# -------------------------------------------------------------------------------------------- initialise
def _generator(seed: int, name: str, device: torch.device) -> torch.Generator:
    """One generator per tensor name on the generating device: the encoder part gets the full model's weights."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator(device=device).manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _initial(name: str, shape: torch.Size, module: nn.Module, g: torch.Generator) -> Tensor:
    """fp32 initial value of one float-form tensor (on the generator's device)."""
    leaf, device = name.rsplit(".", 1)[-1], g.device
    if isinstance(module, RMSNorm) or leaf in ("q_weight", "k_weight", "hc_attn_scale", "hc_ffn_scale", "temperature"):
        return torch.ones(shape, device=device)
    if leaf in ("attn_sink", "bias", "bias_vl"):
        return torch.zeros(shape, device=device)
    noise = torch.randn(shape, generator=g, device=device)
    if leaf in ("hc_attn_base", "hc_ffn_base"):
        return 0.1 * noise
    if leaf in ("hc_attn_fn", "hc_ffn_fn"):
        return noise / shape[1]  # small mixes: near-uniform mixing at start
    if isinstance(module, Embedding):
        return noise
    return noise / math.sqrt(shape[-1])  # linear weights and the MoE gate


def seeded_tensors(
    args: ModelArgs,
    part: Part,
    seed: int,
    device: torch.device | str,
    dtype: torch.dtype,
    skip: Callable[[str], bool] = lambda name: False,
    parallel: Parallel = SINGLE,
) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint tensors of the seeded `part`, one weight at a time, generated and quantised on `device`:
    what `build_model(args, part, seed=seed, parallel=parallel)` holds (a rank's routed experts only), and what
    `model.checkpoint write` stores; a weight `skip` names is not generated (nor its scale)."""
    device = torch.device(device)
    with torch.device("meta"):
        spec = Transformer(args, part, dtype, parallel)
    formats = _formats(spec)
    block = args.quantization_config.expert_scale_block if args.quantization_config else _BLOCK
    owners = {
        f"{m}.{n}" if m else n: mod for m, mod in spec.named_modules() for n, _ in mod.named_parameters(recurse=False)
    }
    owners |= {
        f"{m}.{n}" if m else n: mod for m, mod in spec.named_modules() for n, _ in mod.named_buffers(recurse=False)
    }
    for name, t in spec.state_dict().items():
        if skip(name):
            continue
        value = _initial(name, t.shape, owners[name], _generator(seed, name, device))
        if name in formats:
            data, scale = quantize_weight(value, formats[name], block)
            yield name, data
            yield scale_name(name), stored_form(scale_name(name), scale)
        else:
            yield name, value.to(t.dtype)


def init_weights(model: Transformer, seed: int = 0, skip: Iterable[str] = ()) -> Transformer:
    """Deterministic weights from `seed`, generated on the model's device (either form; quantised ones snapped);
    the `skip` ones are left as they are (another rank fills them)."""
    skip = set(skip)
    tensors = seeded_tensors(model.args, model.part, seed, model.device, model.dtype, parallel=model.parallel)
    store(model, ((n, t) for n, t in tensors if n not in skip), f"seed {seed}", skip=skip)
    # The weights are a pure function of (config, seed, dtype, generating device): every part shares this fingerprint.
    identity = {"seed": torch.tensor(seed), f"dtype={model.dtype}|{model.device.type}": torch.zeros(0)}
    model.fingerprint = model_fingerprint(model.args, identity)
    return model


def build_model(
    args: ModelArgs,
    part: Part = "full",
    *,
    seed: int | None = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    packed: bool = True,
    engram: Placement = "device",
    parallel: Parallel = SINGLE,
    shared: SharedTables | None = None,
) -> Transformer:
    """A model part on `device`, packed (serving) or float (training); initialised from `seed` (None: uninitialised,
    e.g. before a load). A packed model is built on `meta` first, so no float copy of a quantised weight exists.
    `engram`: where the Engram tables live (`model.engram_store`); `mmap` leaves them to the checkpoint loader;
    `host` with `shared`: in the node's table file, which only its owner fills (`model.shared_tables`).
    `parallel`: the expert-parallel rank it is, holding only its routed experts (`model.parallel`)."""
    device = torch.device(device)
    if packed and args.quantization_config is not None:
        with torch.device("meta"):
            model = pack(Transformer(args, part, dtype, parallel), device, engram, shared)
    else:
        with torch.device(device):
            model = Transformer(args, part, dtype, parallel)
        place_engram_tables(model, engram, device, shared)
    if seed is not None and device.type != "meta":
        if engram == "mmap":
            raise ValueError("--engram-store mmap maps the checkpoint's shards: a seeded model has none")
        init_weights(model, seed, skip=filled_elsewhere(model, engram, shared))
    place_tables(model, engram)
    return model


# ---------------------------------------------------------------------------------------------- fingerprint
def model_fingerprint(config: ModelArgs, weights: Mapping[str, Tensor]) -> bytes:
    """BLAKE2b-128 of the canonical config JSON and every weight (name, dtype, shape, bytes) in name order.

    Part of every prefix-cache block key: two models share cached KV only if config and weights are identical.
    """
    h = hashlib.blake2b(digest_size=16, person=b"v41-model")
    h.update(json.dumps(config.to_dict(), sort_keys=True).encode())
    for name in sorted(weights):
        t = weights[name].detach().contiguous().cpu()
        h.update(f"{name}|{t.dtype}|{tuple(t.shape)}|".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.digest()
