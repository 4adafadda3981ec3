"""Weights: deterministic initialisation, safetensors checkpoints with the released names, the model fingerprint.

Checkpoint layout (reference §2.9). Tensor names are the module paths (`layers.3.attn.wq_a.weight`,
`mtp.2.markov_head.embed.weight`, …). With a `quantization_config`:

| weight format | stored tensors                                                                          |
|---------------|-----------------------------------------------------------------------------------------|
| fp8           | `X.weight` E4M3 (float8_e4m3fn) [out, in]; `X.scale` UE8M0 bytes [⌈out/32⌉, ⌈in/32⌉]      |
| fp4 (experts) | `X.weight` packed E2M1 uint8 [out, in/2] (low nibble = even input); `X.scale` UE8M0 [out, in/32] |
| Engram table  | `engram.embed.weight` E4M3 [rows, head_dim]; `engram.embed.scale` UE8M0 [rows, head_dim/32] |
| others        | plain, in the model's dtype (fp32 parameters stay fp32)                                  |

UE8M0 and packed E2M1 are stored as uint8 (the float8_e8m0fnu / float4_e2m1fn_x2 dtypes of the released files are
read too, as their bytes). Without a quantization_config every tensor is plain. In memory a quantised weight holds
exactly the values its stored form decodes to (initialisation snaps to the grid), so save → load is bit-exact.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from collections.abc import Iterator, Mapping
from contextlib import ExitStack
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn
from tqdm.auto import tqdm

from model import quant
from model.config import ModelArgs
from model.dspark import ConfidenceHead
from model.linear import Embedding, Linear, RMSNorm
from model.transformer import Part, Transformer

CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"
_BLOCK = 32  # FP8 weight blocks are 32×32 (quantization_config.weight_block_size)
_FP8_BYTE_DTYPES = (torch.uint8, torch.float8_e4m3fn)


# --------------------------------------------------------------------------------------------- formats
def _formats(model: nn.Module) -> dict[str, str]:
    """Parameter name → storage format ('fp8', 'fp4', 'fp8_rows', or 'plain')."""
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


def quantize_weight(w: Tensor, fmt: str) -> tuple[Tensor, Tensor]:
    """A float weight → its stored (data, scale) pair."""
    if fmt == "fp8":
        blocks, shape = _blocks_2d(w)
        data, scale = quant.fp8_quant(blocks, block=_BLOCK * _BLOCK)
        return _unblock_2d(data, shape).view(torch.float8_e4m3fn), scale.squeeze(-1)
    if fmt == "fp4":
        return quant.fp4_quant_ue8m0(w, block=_BLOCK)
    if fmt == "fp8_rows":
        data, scale = quant.fp8_quant(w, block=_BLOCK)
        return data.view(torch.float8_e4m3fn), scale
    raise ValueError(f"unknown weight format {fmt!r}")


def dequantize_weight(data: Tensor, scale: Tensor, fmt: str, dtype: torch.dtype) -> Tensor:
    data, scale = data.view(torch.uint8), scale.view(torch.uint8)
    if fmt == "fp8":
        O, I = data.shape
        blocks, _ = _blocks_2d(quant.e4m3_decode(data))
        values = blocks * quant.ue8m0_decode(scale).unsqueeze(-1)
        return _unblock_2d(values, (O, I)).to(dtype)
    if fmt == "fp4":
        return quant.fp4_dequant_ue8m0(data, scale, block=_BLOCK, dtype=dtype)
    if fmt == "fp8_rows":
        return quant.fp8_dequant(data, scale, block=_BLOCK, dtype=dtype)
    raise ValueError(f"unknown weight format {fmt!r}")


# -------------------------------------------------------------------------------------------- initialise
def _generator(seed: int, name: str) -> torch.Generator:
    """One generator per parameter, keyed by its name: the encoder part gets the same weights as the full model."""
    digest = hashlib.blake2b(f"{seed}:{name}".encode(), digest_size=8).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest, "little") & (2**63 - 1))


def _initial(name: str, p: Tensor, module: nn.Module, g: torch.Generator) -> Tensor:
    leaf = name.rsplit(".", 1)[-1]
    if isinstance(module, RMSNorm) or leaf in ("q_weight", "k_weight", "hc_attn_scale", "hc_ffn_scale"):
        return torch.ones(p.shape)
    if leaf in ("attn_sink", "bias", "bias_vl"):
        return torch.zeros(p.shape)
    if leaf in ("hc_attn_base", "hc_ffn_base"):
        return 0.1 * torch.randn(p.shape, generator=g)
    if leaf in ("hc_attn_fn", "hc_ffn_fn"):
        return torch.randn(p.shape, generator=g) / p.shape[1]  # small mixes: near-uniform mixing at start
    if isinstance(module, Embedding):
        return torch.randn(p.shape, generator=g)
    return torch.randn(p.shape, generator=g) / math.sqrt(p.shape[-1])  # linear weights and the MoE gate


@torch.no_grad()
def init_weights(model: Transformer, seed: int = 0) -> Transformer:
    """Deterministic weights from `seed` (identical for every part and device); quantised weights snapped."""
    formats = _formats(model)
    owners = {
        f"{m}.{n}" if m else n: mod for m, mod in model.named_modules() for n, _ in mod.named_parameters(recurse=False)
    }
    for name, p in model.named_parameters():
        value = _initial(name, p, owners[name], _generator(seed, name))
        if name in formats:
            value = dequantize_weight(*quantize_weight(value, formats[name]), formats[name], torch.float32)
        p.copy_(value.to(p.dtype))
    # The weights are a pure function of (config, seed): every part of the same seed shares this fingerprint.
    identity = {"seed": torch.tensor(seed), f"dtype={model.dtype}": torch.zeros(0)}
    model.fingerprint = model_fingerprint(model.args, identity)
    return model


def build_model(
    args: ModelArgs,
    part: Part = "full",
    *,
    seed: int | None = 0,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
) -> Transformer:
    """A model part on `device`; initialised from `seed` (None: uninitialised, e.g. before a load)."""
    with torch.device(device):
        model = Transformer(args, part, dtype)
    if seed is not None and torch.device(device).type != "meta":
        init_weights(model, seed)
    return model


# ----------------------------------------------------------------------------------------------- save/load
def state_tensors(model: Transformer) -> Iterator[tuple[str, Tensor]]:
    """The checkpoint's (name, tensor) pairs of a model: quantised weights as data + `.scale`."""
    formats = _formats(model)
    for name, p in model.state_dict().items():
        if name in formats:
            data, scale = quantize_weight(p.detach(), formats[name])
            yield name, data
            yield _scale_name(name), scale
        else:
            yield name, p.detach()


def save_checkpoint(model: Transformer, directory: str | os.PathLike[str]) -> Path:
    """config.json + model.safetensors (the config is also in the safetensors metadata)."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    model.args.to_json(out / CONFIG_FILE)
    tensors = {name: t.contiguous().cpu() for name, t in state_tensors(model)}
    tmp = out / (WEIGHTS_FILE + ".tmp")
    save_file(tensors, str(tmp), metadata={"format": "pt", "config": json.dumps(model.args.to_dict())})
    os.replace(tmp, out / WEIGHTS_FILE)  # never a half-written checkpoint under the real name
    return out


def _shards(directory: Path) -> list[Path]:
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors file in {directory}")
    return files


@torch.no_grad()
def load_weights(model: Transformer, directory: str | os.PathLike[str], progress: bool = False) -> Transformer:
    """Fill a model part from the checkpoint shards in `directory`; tensors of other parts are never read."""
    directory = Path(directory)
    formats, params = _formats(model), model.state_dict()
    with ExitStack() as stack:
        where = {}  # tensor name → the open shard holding it (each shard's header is parsed once)
        for shard in _shards(directory):
            f = stack.enter_context(safe_open(str(shard), framework="pt", device="cpu"))
            where |= dict.fromkeys(f.keys(), f)
        # Buffers are calibrations (the DSpark confidence temperatures), optional: absent, they keep their default.
        buffers = {name for name, _ in model.named_buffers()}
        params = {name: t for name, t in params.items() if name in where or name not in buffers}
        missing = [n for n in params if n not in where]
        missing += [s for n in params if n in formats and (s := _scale_name(n)) not in where]
        if missing:
            raise ValueError(f"checkpoint {directory} lacks {len(missing)} tensors of this model, e.g. {missing[:3]}")
        for name, target in tqdm(params.items(), desc="load", unit="tensor", disable=not progress):
            value = where[name].get_tensor(name)
            if name in formats:
                value = dequantize_weight(
                    value, where[_scale_name(name)].get_tensor(_scale_name(name)), formats[name], target.dtype
                )
            if tuple(value.shape) != tuple(target.shape):
                raise ValueError(f"{name}: checkpoint shape {tuple(value.shape)} != model shape {tuple(target.shape)}")
            target.copy_(value.to(target.dtype))
    for module in model.modules():
        if isinstance(module, ConfidenceHead):
            module.check()
    model.fingerprint = checkpoint_fingerprint(directory)
    return model


def _scale_name(weight_name: str) -> str:
    return weight_name.removesuffix(".weight") + ".scale"


def load_checkpoint(
    directory: str | os.PathLike[str],
    part: Part = "full",
    *,
    device: torch.device | str = "cpu",
    dtype: torch.dtype = torch.float32,
    progress: bool = False,
) -> Transformer:
    """Model part from a checkpoint directory (config.json + safetensors shards)."""
    directory = Path(directory)
    args = ModelArgs.from_json(directory / CONFIG_FILE)
    return load_weights(build_model(args, part, seed=None, device=device, dtype=dtype), directory, progress)


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


def checkpoint_fingerprint(directory: str | os.PathLike[str]) -> bytes:
    """The fingerprint of a checkpoint: its config and every stored tensor of every shard (whatever part loads it)."""
    directory = Path(directory)
    tensors: dict[str, Tensor] = {}
    for shard in _shards(directory):
        with safe_open(str(shard), framework="pt", device="cpu") as f:
            tensors |= {name: f.get_tensor(name) for name in f.keys()}  # noqa: SIM118 (safe_open is not a dict)
    return model_fingerprint(ModelArgs.from_json(directory / CONFIG_FILE), tensors)
