"""One sequence's output constraint as it decodes: free while it reasons, then the grammar and the banned tokens.

    reasoning ──the reasoning's end token──▶ answer: the grammar's next-token set, minus the banned tokens

The reasoning's content is free, but where the grammar needs an answer (a JSON Schema, a required call: one its
stop token cannot end at once) the sequence may not stop inside the reasoning either: a stop there would return
reasoning without the answer the client asked for.

`follow` takes every token the sequence emits, `accept` for the span of one step the DSpark drafts too; `rollback`
undoes drafts the verification will judge (the engine follows the ones it emits). What the next token may be is the
matcher's bitmask without the banned tokens (masking.py fills it).

An emitted token was sampled under this guide's mask, so the grammar takes it: `follow` does the reasoning's
bookkeeping at once and leaves the matcher's step for the next read of its state — the next step's mask fill, which
runs while that step's forward is on the device, instead of between the two forwards. Whether a token completed the
grammar is known without it (only a stop token can). Should the matcher refuse a followed token (a bug: the mask
allowed it), `broken` names it from then on.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Collection

import xgrammar as xgr

_REASONING, _END, _ANSWER = 0, 1, 2  # what an accepted token was
TRAIL = 64  # tokens a guide can undo: more than one step ever drafts


class Guide:
    def __init__(
        self,
        grammar: xgr.CompiledGrammar | None,
        *,
        banned: Collection[int] = (),
        reasoning_end: int | None = None,
        answer_prefix: str = "",
        stop_ids: Collection[int] = (),
    ) -> None:
        """ValueError when the grammar refuses `answer_prefix`."""
        self.matcher = None
        if grammar is not None:
            self.matcher = xgr.GrammarMatcher(grammar, override_stop_tokens=sorted(stop_ids) or None)
            if answer_prefix and not self.matcher.accept_string(answer_prefix):
                raise ValueError(f"the answer's prefix in the prompt does not match the grammar: {answer_prefix!r}")
        self.banned = frozenset(banned)
        self._ends = frozenset(self.matcher.stop_token_ids) if self.matcher is not None else frozenset()
        self.reasoning_end = reasoning_end
        self.in_answer = reasoning_end is None
        # the stop tokens the reasoning may not use: all of them when the grammar cannot take an empty answer
        required = grammar is not None and not self._empty_answer(grammar.tokenizer_info.vocab_size, stop_ids)
        self.no_stop = frozenset(stop_ids) if required else frozenset()
        self._trail: deque[int] = deque(maxlen=TRAIL)  # per recent accepted token: _REASONING, _END or _ANSWER
        self._unsettled: list[int] = []  # answer tokens followed, not yet taken by the matcher
        self.broken: int | None = None  # a followed token the matcher refused

    def _empty_answer(self, vocab_size: int, stop_ids: Collection[int]) -> bool:
        """The grammar takes a stop token right away (an empty answer conforms)."""
        assert self.matcher is not None
        bitmask = xgr.allocate_token_bitmask(1, vocab_size)
        self.matcher.fill_next_token_bitmask(bitmask)
        words = bitmask[0].tolist()
        return any(words[t // 32] >> (t % 32) & 1 for t in stop_ids)

    @property
    def grammar_active(self) -> bool:
        """The grammar decides the next token (in the answer, and not finished)."""
        return self.in_answer and self.matcher is not None and not self._settled().is_terminated()

    @property
    def complete(self) -> bool:
        """The grammar accepted its stop token: the answer is whole and no token may follow."""
        if not self.in_answer or self.matcher is None:
            return False
        if self._unsettled and self._unsettled[-1] not in self._ends:
            return False  # only the grammar's stop token ends it
        return self._settled().is_terminated()

    @property
    def banned_now(self) -> frozenset[int]:
        """The tokens the next position may not take besides the grammar's: the banned ones in the answer, the stop
        tokens in a reasoning that must reach its answer."""
        return self.banned if self.in_answer else self.no_stop

    @property
    def restricts(self) -> bool:
        """Anything restricts the next token."""
        return self.grammar_active or bool(self.banned_now)

    @property
    def portable(self) -> bool:
        """It holds no grammar matcher: a copy of it can travel to the rank holding its row (a pickle)."""
        return self.matcher is None

    def follow(self, token: int) -> bool:
        """Follow an emitted token, sampled under this guide's mask; False (and nothing followed) when the constraint
        refuses it on its face — in a reasoning that may not stop, banned, after the grammar's end. The matcher takes
        it on the next read of the guide's state (a refusal there sets `broken`)."""
        if not self.in_answer or self.matcher is None:
            return self.accept(token)
        if token in self.banned or self.complete:
            return False
        self._unsettled.append(token)
        self._trail.append(_ANSWER)
        return True

    def settle(self) -> int | None:
        """The matcher takes the followed tokens now → the one it refused (`broken`), if any."""
        if self.matcher is not None:
            self._settled()
        return self.broken

    def _settled(self) -> xgr.GrammarMatcher:
        """The matcher, past every followed token."""
        assert self.matcher is not None
        for i, token in enumerate(self._unsettled):
            if self.matcher.is_terminated() or not self.matcher.accept_token(token):
                self.broken = token
                for _ in self._unsettled[i:]:  # never taken: nothing to undo for them
                    self._trail.pop()
                break
        self._unsettled.clear()
        return self.matcher

    def accept(self, token: int) -> bool:
        """Follow one more token; False (and nothing followed) when the constraint does not allow it."""
        if not self.in_answer:
            if token in self.no_stop:
                return False
            end = token == self.reasoning_end
            self._trail.append(_END if end else _REASONING)
            self.in_answer = end
            return True
        if token in self.banned:
            return False
        if self.matcher is not None and (self._settled().is_terminated() or not self.matcher.accept_token(token)):
            return False  # (nothing follows the stop token that completed the grammar)
        self._trail.append(_ANSWER)
        return True

    def rollback(self, n: int) -> None:
        """Undo the last n accepted tokens."""
        if n <= 0:
            return
        if self.matcher is not None:
            self._settled()
        if n > len(self._trail):
            raise ValueError(f"cannot undo {n} tokens: only the last {len(self._trail)} are remembered")
        undone = [self._trail.pop() for _ in range(n)]
        answer = undone.count(_ANSWER)
        if answer and self.matcher is not None:
            self.matcher.rollback(answer)
        if _END in undone:
            self.in_answer = False
