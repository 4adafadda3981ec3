"""The incremental output parser: model text → reasoning, answer, tool calls, stop.

One explicit state machine. Each stage has *branches*, markers that end it; the earliest marker to
complete wins (ties go to the earlier branch), the text before it gets the stage's action, the marker
its own, and the next stage starts fresh. A marker cut by a chunk boundary is held back until it
completes or fails, so the result is the same for any chunking of the same text.

The markers and their precedence are deepseek-recipe's (a byte-level KMP matcher there); this parser
finds them with `str.find` on the pending text, which gives the same matches. Two details are kept on
purpose: a marker that absorbs preceding newlines (`\\n*</think>`, `\\n*<｜DSML｜`) does not count a
newline that directly follows a broken partial marker, and leading newlines are dropped one at a time.

In token mode the template tokens `</think>` and `｜DSML｜` reach the parser as private sentinels, so
text that merely spells them (made of ordinary tokens) is never taken for a marker.
"""

from __future__ import annotations

import enum
import functools
import re
from collections.abc import Callable
from typing import NamedTuple

import msgspec

from recipe.options import ParsingOptions


class Stage(enum.IntEnum):
    CONTENT = 0
    JSON = 1
    MATCHED_JSON = 2
    TOOL_CALLS = 3
    TOOL_NAME = 4
    TOOL_ARGS = 5
    PARAM_NAME = 6
    PARAM_TYPE = 7
    PARAM_VALUE = 8
    REASONING = 9
    FINISHED = 10


class Out(enum.IntEnum):
    """What the parser reports: text kinds (coalesced), tool-call boundaries, a matched stop sequence."""

    REASONING = 0
    CONTENT = 1
    TOOL_START = 2
    ARGS = 3
    TOOL_END = 4
    STOP = 5


class _Match(enum.IntEnum):
    STRING = 0
    NEWLINES = 1  # `\n*` + string
    LEADING = 2  # one newline at the very start of a stage


class _Act(enum.IntEnum):
    SKIP = 0
    RAW = 1
    SPACE = 2
    REASONING = 3
    NAME = 4
    ARGS_RAW = 5
    ARGS_STRING = 6
    LABEL = 7
    JSON_LABEL = 8
    TOOL_BEGIN = 9
    TOOL_NAME_END = 10
    ARGS_END = 11
    STOP = 12


class _Branch(NamedTuple):
    match: _Match
    pattern: str
    stage: Stage
    flag: bool  # the next stage's flag: leading (content, reasoning, arguments) or string (parameter value)
    act: _Act
    label: str = ""


# Stages whose text passes through as-is, and those whose input ranges `track` reports.
_PLAIN = {_Act.RAW: Out.CONTENT, _Act.REASONING: Out.REASONING, _Act.ARGS_RAW: Out.ARGS}
_SPANNED = {_Act.RAW: Out.CONTENT, _Act.REASONING: Out.REASONING, _Act.SPACE: Out.CONTENT}
_COALESCED = frozenset({Out.REASONING, Out.CONTENT, Out.ARGS})  # consecutive pieces of a kind join up
# Python 3.11 looks an enum member up on its class in ~90 ns; the per-chunk code uses these names instead.
_SKIP, _SPACE, _NAME, _ARGS_STRING, _LABEL = _Act.SKIP, _Act.SPACE, _Act.NAME, _Act.ARGS_STRING, _Act.LABEL
_LEADING, _NEWLINES = _Match.LEADING, _Match.NEWLINES
_ARGS = Out.ARGS


class Markers(NamedTuple):
    """The spellings the parser looks for: literal text, or sentinels in token mode."""

    think_end: str = "</think>"
    dsml: str = "｜DSML｜"


TEXT_MARKERS = Markers()
JSON_BEGIN_LABELS = ("```json\n", "```\n")
JSON_END_LABEL = "\n```"

_escape_json = msgspec.json.encode


def _partial(text: str, pattern: str) -> int:
    """Length of the longest proper prefix of `pattern` that `text` ends with."""
    first = pattern[0]
    index = text.find(first, max(0, len(text) - len(pattern) + 1))
    while index >= 0:
        if pattern.startswith(text[index:]):
            return len(text) - index
        index = text.find(first, index + 1)
    return 0


def _cut_markers(patterns: list[str]) -> str:
    """A regular expression for a proper prefix of any of `patterns`: a marker cut by the end of the text.

    Written as a trie (`p(?:a(?:r)?)?`) so the engine tries each start position once, not once per prefix."""
    tree: dict = {}
    for pattern in patterns:
        node = tree
        for char in pattern[:-1]:
            node = node.setdefault(char, {})

    def alternatives(node: dict) -> str:
        options = [re.escape(char) + (f"(?:{alternatives(rest)})?" if rest else "") for char, rest in node.items()]
        return "(?:" + "|".join(options) + ")"

    return alternatives(tree) if tree else ""


class _Stage(NamedTuple):
    branches: tuple[_Branch, ...]
    unmatched: _Act
    trigger: re.Pattern[str]  # characters that can start a marker (or a newline run before one)
    # Stages whose markers are plain strings, none inside another (the DSML stages): one search (the `search`
    # of a compiled pattern) finds the earliest marker, or else the tail that may still become one (none can
    # sit inside such a tail).
    search: Callable[[str, int], re.Match[str] | None] | None
    by_marker: dict[str, _Branch]
    lookback: bool  # a `\n*marker` branch looks at the stage's earlier text (see `_newlines_before`)
    triggers: str  # the trigger characters, tested one by one (`in` is faster than a search on short chunks)
    plain: Out | None  # the kind of text the stage passes through unchanged
    spanned: Out | None  # the kind whose input ranges `track` reports
    leading: bool  # leading newlines are dropped (reasoning and answer with the flag set)
    skips: bool  # the stage drops its text (tool-call markup)


@functools.lru_cache(maxsize=256)
def _stage_table(options: ParsingOptions, markers: Markers, sentinels: tuple[str, ...]) -> dict:
    """The (lazily filled) stage specifications of parsers with these settings."""
    return {}


class Parser:
    """Feed text chunks, get `(Out, text)` items; `finish()` flushes what is held back.

    After a matched stop sequence `stopped` is True and the parser ignores further text; after the
    tool-calls block closes, later text is discarded too.
    """

    def __init__(
        self,
        options: ParsingOptions,
        markers: Markers = TEXT_MARKERS,
        restore: dict[str, str] | None = None,
        *,
        track: bool = False,
    ) -> None:
        self.options = options
        self.markers = markers
        self._restore = restore or {}
        # With `track`, `spans` lists the input ranges (offsets into all text fed) of reasoning and answer
        # text each feed emitted, so logprobs can follow the tokens they belong to.
        self.track = track
        self.spans: list[tuple[Out, int, int]] = []
        self.fed = 0
        # Stage tables depend only on the options and markers: parsers that share them share the table.
        self._stages = _stage_table(options, markers, tuple(self._restore))
        self.stop_sequence: str | None = None
        self.tool_calls = 0
        self._out: list[tuple[Out, str]] = []
        self._held = ""
        self._context = ""  # text flushed earlier in this stage (its tail decides a newline quirk)
        self._name: list[str] = []
        self._spaced = False
        self._base = 0
        if options.starts_in_tool_calls:
            self._enter(Stage.TOOL_CALLS, False)
        elif options.thinking_stage == "reasoning_start":
            self._enter(Stage.REASONING, True)
        elif options.thinking_stage == "reasoning_continuation":
            self._enter(Stage.REASONING, False)
        elif options.thinking_stage == "content_continuation":
            self._enter(Stage.CONTENT, False)
        else:
            self._enter(Stage.CONTENT, True)

    @property
    def stopped(self) -> bool:
        return self.stop_sequence is not None

    @property
    def resolved(self) -> int:
        """How much of the text fed so far is decided (the rest is held back as a possible marker)."""
        return self.fed - len(self._held)

    def feed(self, chunk: str) -> list[tuple[Out, str]]:
        if self._plain is not None:
            kind = self.feed_plain(chunk)
            if kind is not None:
                return [(kind, chunk)]
        held = self._held
        self._out = []
        if self.track:
            self.spans = []
            self._base = self.fed - len(held)
        self.fed += len(chunk)
        if held:
            self._held = ""
            chunk = held + chunk
        self._scan(chunk)
        return self._out

    def feed_plain(self, chunk: str) -> Out | None:
        """The fast path: take all of `chunk` if the stage passes its text through and no marker can start in
        the chunk, and say what kind of text it is; otherwise take nothing (None: `feed` it)."""
        plain = self._plain
        if plain is None or self._held or not chunk:
            return None
        for char in self._triggers:
            if char in chunk:
                return None
        start = self.fed
        self.fed = start + len(chunk)
        self.fresh = False
        self._context = ""  # text without trigger characters ends no partial marker
        if self.track:
            self.spans = [(plain, start, self.fed)] if self._spec.spanned is not None else []
        return plain

    def finish(self) -> list[tuple[Out, str]]:
        self._out = []
        self.spans = []
        if self._held:
            self._base = self.fed - len(self._held)
            self._unmatched(self._held, 0)
            self._held = ""
        return self._out

    # -- stages -----------------------------------------------------------------------------------------

    def _enter(self, stage: Stage, flag: bool) -> None:
        spec = self._stages.get((stage, flag))
        if spec is None:
            spec = self._stages[(stage, flag)] = self._build(stage, flag)
        self.stage, self.flag, self._spec = stage, flag, spec
        # What the per-chunk code reads, as attributes of the parser (faster to read than the spec's fields).
        self._triggers = spec.triggers
        self._search = spec.search
        self._plain = spec.plain
        self._skips = spec.skips
        self.fresh = flag and spec.leading
        self._context = ""
        self._spaced = False

    def _build(self, stage: Stage, flag: bool) -> _Stage:
        opts, m = self.options, self.markers
        dsml_begin = _Branch(_Match.NEWLINES, "<" + m.dsml, Stage.TOOL_CALLS, False, _Act.SKIP)
        dsml_end = "</" + m.dsml
        stops = [_Branch(_Match.STRING, s, Stage.FINISHED, False, _Act.STOP) for s in opts.stop_sequences if s]
        branches: list[_Branch] = []
        if stage is Stage.CONTENT:
            if opts.parse_json_output:
                branches += [_Branch(_Match.STRING, label, Stage.JSON, False, _Act.SKIP) for label in JSON_BEGIN_LABELS]
                branches += [_Branch(_Match.STRING, c, Stage.JSON, False, _Act.JSON_LABEL, c) for c in "{["]
            else:
                branches += stops
            if opts.parse_tool_calls:
                branches.append(dsml_begin)
            if flag:
                branches.append(_Branch(_Match.LEADING, "\n", Stage.CONTENT, True, _Act.SKIP))
            branches.append(_Branch(_Match.STRING, m.think_end, Stage.CONTENT, False, _Act.SKIP))
            unmatched = _Act.SPACE if opts.parse_json_output else _Act.RAW
        elif stage is Stage.JSON:
            branches += [*stops, _Branch(_Match.STRING, JSON_END_LABEL, Stage.MATCHED_JSON, False, _Act.SKIP)]
            unmatched = _Act.RAW
        elif stage is Stage.MATCHED_JSON:
            if opts.parse_tool_calls:
                branches.append(dsml_begin)
            unmatched = _Act.SPACE
        elif stage is Stage.TOOL_CALLS:
            branches.append(_Branch(_Match.STRING, 'invoke name="', Stage.TOOL_NAME, False, _Act.TOOL_BEGIN))
            for block in ("tool_calls", " calls"):
                branches.append(_Branch(_Match.STRING, f"{dsml_end}{block}>", Stage.FINISHED, False, _Act.SKIP))
            unmatched = _Act.SKIP
        elif stage is Stage.TOOL_NAME:
            branches.append(_Branch(_Match.STRING, '"', Stage.TOOL_ARGS, True, _Act.TOOL_NAME_END))
            unmatched = _Act.NAME
        elif stage is Stage.TOOL_ARGS:
            label, end = ('{"', "{}") if flag else (', "', "}")
            branches.append(_Branch(_Match.STRING, 'parameter name="', Stage.PARAM_NAME, False, _Act.LABEL, label))
            branches.append(_Branch(_Match.STRING, dsml_end, Stage.TOOL_CALLS, False, _Act.ARGS_END, end))
            unmatched = _Act.SKIP
        elif stage is Stage.PARAM_NAME:
            branches.append(_Branch(_Match.STRING, '"', Stage.PARAM_TYPE, False, _Act.LABEL, '": '))
            # Escaped, so a name with a newline or backslash still makes valid JSON (deepseek-recipe copies it raw).
            unmatched = _Act.ARGS_STRING
        elif stage is Stage.PARAM_TYPE:
            branches.append(_Branch(_Match.STRING, 'true">', Stage.PARAM_VALUE, True, _Act.LABEL, '"'))
            branches.append(_Branch(_Match.STRING, 'false">', Stage.PARAM_VALUE, False, _Act.SKIP))
            unmatched = _Act.SKIP
        elif stage is Stage.PARAM_VALUE:
            act = _Act.LABEL if flag else _Act.SKIP
            branches.append(_Branch(_Match.STRING, dsml_end, Stage.TOOL_ARGS, False, act, '"'))
            unmatched = _Act.ARGS_STRING if flag else _Act.ARGS_RAW
        elif stage is Stage.REASONING:
            if opts.parse_tool_calls:
                branches.append(dsml_begin)
            if flag:
                branches.append(_Branch(_Match.LEADING, "\n", Stage.REASONING, True, _Act.SKIP))
            branches.append(_Branch(_Match.NEWLINES, m.think_end, Stage.CONTENT, True, _Act.SKIP))
            unmatched = _Act.REASONING
        else:
            unmatched = _Act.SKIP
        starts = {b.pattern[0] for b in branches} | {"\n" for b in branches if b.match is not _Match.STRING}
        starts |= set(self._restore)  # token mode: sentinels must be spelled out, not passed through
        trigger = re.compile("[" + "".join(re.escape(c) for c in sorted(starts)) + "]" if starts else "(?!)")
        patterns = [b.pattern for b in branches]
        simple = bool(branches) and all(
            b.match is _Match.STRING and not any(b.pattern in other for other in patterns if other != b.pattern)
            for b in branches
        )
        scanner = None
        if simple:
            cut = _cut_markers(patterns)
            scanner = re.compile("|".join(re.escape(p) for p in patterns) + (f"|{cut}\\Z" if cut else ""))
        plain = _PLAIN.get(unmatched)
        return _Stage(
            branches=tuple(branches),
            unmatched=unmatched,
            trigger=trigger,
            search=None if scanner is None else scanner.search,
            by_marker={b.pattern: b for b in branches},
            lookback=any(b.match is _Match.NEWLINES for b in branches),
            triggers="".join(sorted(starts)),
            plain=plain,
            spanned=_SPANNED.get(unmatched),
            leading=stage in (Stage.CONTENT, Stage.REASONING),
            skips=unmatched is _Act.SKIP,
        )

    # -- matching ---------------------------------------------------------------------------------------

    def _scan(self, text: str) -> None:
        """Work through `text` stage by stage; a tail that may still become a marker is held back."""
        pos, size = 0, len(text)
        while pos < size:  # the finished stage has no markers: its step takes the rest
            search = self._search
            if search is None:
                pos = self._next_branch(text, pos)
                continue
            # A stage of plain markers: up to the earliest marker, or to the end holding a cut one.
            found = search(text, pos)
            if found is None:
                if not self._skips:
                    self._unmatched(text[pos:], pos)
                return
            start, end = found.span()
            if start > pos and not self._skips:
                self._unmatched(text[pos:start], pos)
            marker = found.group()
            branch = self._spec.by_marker.get(marker)
            if branch is None:  # a cut marker, at the end
                self._held = marker
                return
            self._take(branch, marker)
            pos = end

    def _take(self, branch: _Branch, marker: str) -> None:
        """The one transition: `branch`'s marker matched, its action runs and its stage starts."""
        act = branch.act
        if act is _SKIP:  # (most markers of tool-call markup, tested first)
            pass
        elif act is _LABEL:
            self._emit(_ARGS, branch.label)
        elif act is _Act.JSON_LABEL:
            self._emit(Out.CONTENT, branch.label)
        elif act is _Act.TOOL_BEGIN:
            self._name = []
        elif act is _Act.TOOL_NAME_END:
            self.tool_calls += 1
            self._emit(Out.TOOL_START, "".join(self._name))
        elif act is _Act.ARGS_END:
            self._emit(Out.ARGS, branch.label)
            self._emit(Out.TOOL_END, "")
        elif act is _Act.STOP:
            self.stop_sequence = marker
            self._emit(Out.STOP, marker)
        self._enter(branch.stage, branch.flag)

    def _next_branch(self, text: str, pos: int) -> int:
        """One step of any stage: the earliest branch to complete wins; if none can, the end is held back."""
        spec = self._spec
        hit = spec.trigger.search(text, pos)
        if hit is None:
            self.fresh = False
            self._unmatched(text[pos:], pos)
            return len(text)
        if hit.start() > pos:
            self.fresh = False
            self._unmatched(text[pos : hit.start()], pos)
            pos = hit.start()
        size = len(text)
        best: _Branch | None = None
        best_start = best_end = size + 1
        for branch in spec.branches:
            if branch.match is _LEADING:
                if not self.fresh or text[pos] != "\n":
                    continue
                start, end = pos, pos + 1
            else:
                start = text.find(branch.pattern, pos)
                if start < 0:
                    continue
                end = start + len(branch.pattern)
                if branch.match is _NEWLINES:
                    start = self._newlines_before(text, pos, start, branch.pattern)
            if end < best_end:
                best, best_start, best_end = branch, start, end
        if best is not None:
            self._unmatched(text[pos:best_start], pos)
            self._take(best, text[best_start:best_end])
            return best_end
        rest = text[pos:]
        hold = max((self._holding(rest, branch) for branch in spec.branches), default=0)
        self.fresh = False
        self._unmatched(rest[: len(rest) - hold], pos)
        self._held = rest[len(rest) - hold :]
        return size

    def _newlines_before(self, text: str, pos: int, start: int, pattern: str) -> int:
        """Where a `\\n*pattern` match begins: the newlines right before `start` (within this stage),
        less the first one if it followed a partial `pattern` (the matcher had not reset yet)."""
        run = start
        while run > pos and text[run - 1] == "\n":
            run -= 1
        if run < start and _partial(self._context + text[pos:run], pattern):
            run += 1
        return run

    def _holding(self, rest: str, branch: _Branch) -> int:
        """How much of `rest`'s tail may still become `branch`'s marker."""
        if branch.match is _Match.LEADING:
            return 0
        held = _partial(rest, branch.pattern)
        if branch.match is _Match.NEWLINES:
            end = len(rest) - held
            held += end - self._newlines_before(rest, 0, end, branch.pattern)
        return held

    # -- output -----------------------------------------------------------------------------------------

    def _emit(self, kind: Out, text: str) -> None:
        if self._restore:
            for sentinel, spelling in self._restore.items():
                if sentinel in text:
                    text = text.replace(sentinel, spelling)
        out = self._out
        if out and out[-1][0] is kind and kind in _COALESCED:
            out[-1] = (kind, out[-1][1] + text)
        else:
            out.append((kind, text))

    def _unmatched(self, text: str, at: int) -> None:
        """Emit `text` (found at `at` in the scanned text) with the stage's action."""
        spec = self._spec
        act = spec.unmatched
        if act is _SKIP or not text:  # the most common case inside tool-call markup
            return
        if spec.lookback:
            self._context = (self._context + text)[-32:]
        if spec.plain is not None:
            self._emit(spec.plain, text)
        elif act is _ARGS_STRING:
            self._emit(_ARGS, _escape_json(text)[1:-1].decode())
        elif act is _NAME:
            self._name.append(text)
        elif act is _SPACE and not self._spaced:
            self._spaced = True
            self._emit(Out.CONTENT, " ")
        if self.track and spec.spanned is not None:
            start = self._base + at
            self.spans.append((spec.spanned, start, start + len(text)))
