"""Grammar-constrained decoding in the engine (tiny model, driven one iteration at a time): a mask changes nothing
when the free output already conforms and forces the grammar when it does not, each row of a batch on its own; DSpark
drafts are judged by the grammar and verified against the masked target, so speculation gives the plain lane's
tokens, with drafts really accepted; the reasoning is free until its end token; banned tokens never appear in the
answer."""

from __future__ import annotations

import asyncio
import json

import pytest
import torch
import xgrammar as xgr
from driven import GREEDY, Driven, driven_engine
from test_decode_speculation import oracle_drafter

from decode_svc import masking
from decode_svc.grammar import Grammars, default_tokenizer, vocabulary
from decode_svc.guide import Guide
from decode_svc.masking import Masks, admitted
from decode_svc.sequence import Failure, State
from model import Transformer
from proto.decode.v1 import decode_pb2
from recipe import load_tokenizer

LIMIT = 10
EOS = 1


@pytest.fixture(scope="module")
def grammars(models: tuple[Transformer, Transformer]) -> Grammars:
    return Grammars(vocabulary(default_tokenizer(), models[1].args.vocab_size))


def exactly(text: str) -> decode_pb2.OutputConstraint:
    """A grammar that admits `text` and nothing else."""
    tag = {"type": "structural_tag", "format": {"type": "const_string", "value": text}}
    return decode_pb2.OutputConstraint(structural_tag=json.dumps(tag))


def guide(grammars: Grammars, constraint: decode_pb2.OutputConstraint, **fields: object) -> Guide:
    compiled = asyncio.run(grammars.compile(constraint))
    return Guide(compiled, stop_ids=[EOS], **fields)  # type: ignore[arg-type]


def run(
    model: Transformer, prompts: list[list[int]], guides: list[Guide | None], speculate: bool = False
) -> tuple[list[list[int]], Driven]:
    """Greedy outputs of the prompts decoded together (EOS stops), each row under its guide."""
    with driven_engine(model, speculation=speculate, max_draft=3, draft_policy="full") as d:
        stop = frozenset({EOS})
        seqs = [
            d.submit(ids, LIMIT, sampling=GREEDY, speculate=speculate, stop_token_ids=stop, guide=g)
            for ids, g in zip(prompts, guides, strict=True)
        ]
        d.run_to_end(*seqs)
        return [seq.output for seq in seqs], d


@pytest.fixture(scope="module")
def conforming(models: tuple[Transformer, Transformer]) -> tuple[list[int], list[int], str]:
    """A prompt whose free greedy output is plain text (no control token, whole UTF-8): (prompt, output, its text)."""
    tokenizer = load_tokenizer()
    control = set(tokenizer.added.values())
    for seed in range(40):
        prompt = torch.randint(100, 100_000, (12,), generator=torch.Generator().manual_seed(seed)).tolist()
        (free,), _ = run(models[1], [prompt], [None])
        raw = b"".join(tokenizer.token_bytes(t) for t in free)
        if not control & set(free):
            try:
                return prompt, free, raw.decode()
            except UnicodeDecodeError:
                continue
    raise AssertionError("no prompt of the tiny model decodes to plain text")


def test_a_mask_changes_nothing_when_the_output_conforms(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    prompt, free, text = conforming
    for speculate in (False, True):
        (masked,), _ = run(models[1], [prompt], [guide(grammars, exactly(text + "!"))], speculate)
        assert masked == free


def test_the_grammar_decides_when_the_output_does_not_conform(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    prompt, free, _ = conforming
    tokenizer = load_tokenizer()
    (forced,), _ = run(models[1], [prompt], [guide(grammars, exactly("Hi"))])
    assert forced[-1] == EOS  # the grammar is complete: only the stop token was left
    assert tokenizer.decode(forced[:-1]) == "Hi"
    assert forced != free


def test_each_row_of_a_batch_follows_its_own_constraint(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    prompt = conforming[0]
    other = [p + 7 for p in prompt]
    alone = {
        "free": run(models[1], [other], [None])[0][0],
        "json": run(models[1], [prompt], [guide(grammars, decode_pb2.OutputConstraint(json_object=True))])[0][0],
    }
    for speculate in (False, True):
        together, _ = run(
            models[1],
            [prompt, other, prompt],
            [guide(grammars, decode_pb2.OutputConstraint(json_object=True)), None, guide(grammars, exactly("Hi"))],
            speculate,
        )
        assert together[0] == alone["json"]
        assert together[1] == alone["free"]
        assert load_tokenizer().decode(together[2][:-1]) == "Hi"


@pytest.mark.parametrize("drafter", ["constrained", "free"])
def test_speculation_is_lossless_under_a_constraint(
    models: tuple[Transformer, Transformer],
    grammars: Grammars,
    conforming: tuple[list[int], list[int], str],
    drafter: str,
) -> None:
    """Drafts forced by an oracle Markov head — along the constrained output (accepted), or along the free output
    (the grammar refuses them: the masks pick others) — never change the tokens."""
    prompt, free, _ = conforming

    def constraint() -> Guide:
        return guide(grammars, exactly("Hello, world"))

    (plain,), _ = run(models[1], [prompt], [constraint()])
    oracle = oracle_drafter(models[1], plain if drafter == "constrained" else free)
    (spec,), d = run(oracle, [prompt], [constraint()], speculate=True)
    assert spec == plain
    if drafter == "constrained":
        assert d.metric("draft_accepted_tokens_total") > 0  # the verify pass judged drafts against masked targets


def test_the_reasoning_is_free_and_banned_tokens_stay_out_of_the_answer(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    prompt, free, _ = conforming
    json_only = decode_pb2.OutputConstraint(json_object=True)
    never_ends = 128822  # `</think>`, which the free output does not hold: all of it is reasoning
    assert never_ends not in free
    (reasoning,), _ = run(models[1], [prompt], [guide(grammars, json_only, reasoning_end=never_ends)])
    assert reasoning == free
    ends_first = free[0]  # the first token ends the reasoning: the grammar takes over from the second
    (answered,), _ = run(models[1], [prompt], [guide(grammars, json_only, reasoning_end=ends_first)])
    assert answered[0] == free[0]
    assert answered != free
    banned = free[2]
    for speculate in (False, True):
        ban = guide(grammars, decode_pb2.OutputConstraint(), banned=[banned])
        (without,), _ = run(models[1], [prompt], [ban], speculate)
        assert without[:2] == free[:2]
        assert banned not in without


def test_a_guide_undoes_drafts_across_the_reasoning_end(grammars: Grammars) -> None:
    g = guide(grammars, decode_pb2.OutputConstraint(json_object=True), reasoning_end=128822, banned=[128825])
    assert g.accept(5)
    assert (g.in_answer, g.banned_now) == (False, {EOS})  # a JSON answer must come: no stop inside the reasoning
    assert not g.accept(EOS)
    assert g.accept(128822)
    assert (g.in_answer, g.restricts) == (True, True)
    assert not g.accept(128825)  # banned in the answer
    assert g.accept(load_tokenizer().encode_plain("{")[0])
    g.rollback(2)
    assert (g.in_answer, g.banned_now) == (False, {EOS})
    assert g.accept(128825)  # the reasoning is free


def _allowed(g: Guide, vocab: int) -> list[int]:
    """The tokens g's grammar allows next (xgrammar's bitmask, as masking.py fills it)."""
    bitmask = xgr.allocate_token_bitmask(1, vocab)
    g.matcher.fill_next_token_bitmask(bitmask)  # type: ignore[union-attr]
    words = bitmask[0].tolist()
    return [t for t in range(vocab) if words[t // 32] >> (t % 32) & 1]


def test_followed_tokens_reach_the_matcher_on_its_next_read(
    models: tuple[Transformer, Transformer], grammars: Grammars
) -> None:
    """`follow` (the engine's emitted tokens) leaves the matcher's step for later: the next read of the guide sees
    the state an eager `accept` gives, drafts walk and roll back past followed tokens, only the grammar's stop token
    completes it, and a token the matcher refuses is named by `broken` and leaves the state before it."""
    vocab, text = models[1].args.vocab_size, load_tokenizer().encode_plain('{"a": 1}')
    lazy, eager = guide(grammars, exactly('{"a": 1}')), guide(grammars, exactly('{"a": 1}'))
    for token in text[:-1]:
        assert (lazy.follow(token), eager.accept(token)) == (True, True)
    assert lazy._unsettled == text[:-1]  # nothing taken yet
    assert not lazy.complete  # not a stop token: the matcher is not asked
    assert (lazy.grammar_active, lazy._unsettled) == (True, [])  # a read: the matcher took them
    assert _allowed(lazy, vocab) == _allowed(eager, vocab) == [text[-1]]
    assert (lazy.accept(text[-1]), lazy.accept(EOS)) == (True, True)
    lazy.rollback(2)  # drafts judged: the followed tokens stay taken
    assert _allowed(lazy, vocab) == [text[-1]]
    assert (lazy.follow(text[-1]), lazy.follow(EOS)) == (True, True)
    assert (lazy.complete, lazy.follow(text[0])) == (True, False)  # nothing follows the end
    assert (lazy.broken, lazy.settle()) == (None, None)

    refused, before = guide(grammars, exactly('{"a": 1}')), guide(grammars, exactly('{"a": 1}'))
    assert (refused.follow(text[0]), before.accept(text[0])) == (True, True)
    assert refused.follow(text[0])  # taken on its face; the grammar refuses a second one
    assert (refused.broken, refused.settle(), refused.broken) == (None, text[0], text[0])
    assert _allowed(refused, vocab) == _allowed(before, vocab)
    with pytest.raises(ValueError, match="only the last 1"):
        refused.rollback(2)  # the refused token left no trace to undo
    refused.rollback(1)
    assert _allowed(refused, vocab) == _allowed(guide(grammars, exactly('{"a": 1}')), vocab)


def test_a_reasoning_may_stop_only_where_an_empty_answer_conforms(grammars: Grammars) -> None:
    """Where the grammar takes the stop token at once (an empty answer conforms: here, banned tokens only, or an
    empty literal), the reasoning may end the sequence; under a grammar that needs an answer it may not."""
    for free in (decode_pb2.OutputConstraint(), exactly("")):
        g = guide(grammars, free, reasoning_end=128822)
        assert (g.restricts, g.accept(EOS)) == (False, True)
    required = guide(grammars, exactly("ok"), reasoning_end=128822)
    assert (required.restricts, required.accept(EOS)) == (True, False)


def test_a_sequence_ends_where_its_grammar_does_even_without_stop_tokens(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    """A request that stops at no token (a token-ids client) under a grammar: once the grammar takes its own stop
    token nothing may follow, so the sequence finishes there (FINISH_REASON_STOP) instead of failing its next token."""
    prompt, _, _ = conforming
    compiled = asyncio.run(grammars.compile(exactly("Hi")))
    for speculate in (False, True):
        with driven_engine(models[1], speculation=speculate, max_draft=3, draft_policy="full") as d:
            seq = d.submit(prompt, LIMIT, sampling=GREEDY, speculate=speculate, guide=Guide(compiled))
            d.run_to_end(seq)
            *_, end = d.received(seq)
        assert load_tokenizer().decode(seq.output[:-1]) == "Hi"
        assert seq.output[-1] == EOS  # the grammar's terminator, the tokenizer's end of sequence
        assert end.reason == decode_pb2.FINISH_REASON_STOP


def test_a_followed_token_the_grammar_refuses_fails_its_sequence_only(
    models: tuple[Transformer, Transformer], grammars: Grammars, conforming: tuple[list[int], list[int], str]
) -> None:
    """A token the guide took on its face and its matcher refuses when it next reads it (a mask that let it through:
    a bug) fails that sequence before its next tokens are sent; the row beside it decodes on."""
    prompt, free, _ = conforming
    compiled = asyncio.run(grammars.compile(exactly("Hi")))
    bad = load_tokenizer().encode_plain("Ho")[0]
    for speculate in (False, True):
        with driven_engine(models[1], speculation=speculate, max_draft=3, draft_policy="full") as d:
            broken, beside = Guide(compiled), None
            assert broken.follow(bad)  # as if a step had emitted it
            seqs = [d.submit(prompt, LIMIT, sampling=GREEDY, speculate=speculate, guide=g) for g in (broken, beside)]
            d.run_to_end(*seqs)
            (failure,) = d.received(seqs[0])
        assert (seqs[0].state, seqs[0].output) == (State.FAILED, [])
        assert isinstance(failure, Failure)
        assert failure.message == f"token {bad} breaks the output constraint"
        assert seqs[1].output == free[:LIMIT]


def test_a_verify_masks_each_position_as_a_plain_step_after_the_drafts_before_it(
    models: tuple[Transformer, Transformer], grammars: Grammars
) -> None:
    """`admitted` takes each row's drafts up to the first its guide refuses (across the reasoning's end, a banned
    token, a grammar), leaving the guides where they were; a verify's masks at position j are those of a plain step
    after the row's first j drafts, and the positions past a row's drafts stay unmasked; a draft chain masks its
    first link only."""
    think_end, dsml, json_only = 128822, 128825, decode_pb2.OutputConstraint(json_object=True)
    text = load_tokenizer().encode_plain('{"a": [1, 2]}')
    guides: list[Guide | None] = [
        guide(grammars, json_only, reasoning_end=think_end, banned=[dsml]),
        guide(grammars, json_only, banned=[dsml]),
        guide(grammars, json_only),
        None,
    ]
    drafts = [[5, think_end, *text[:2], dsml], [*text[:3], *load_tokenizer().encode_plain("hi")], [dsml, 7], [9, 9]]
    assert admitted(guides, drafts) == [4, 3, 0, 2]
    assert (guides[0].in_answer, guides[1].in_answer) == (False, True)  # type: ignore[union-attr]
    assert admitted(guides, drafts) == [4, 3, 0, 2]  # the guides were left where they started

    kept = [row[:n] for row, n in zip(drafts, admitted(guides, drafts), strict=True)]
    vocab = models[1].args.vocab_size
    logits = torch.zeros(len(guides), 6, vocab)
    Masks(guides, kept).apply(logits)
    assert_each_position_masked_alone(logits, guides, kept)
    assert logits[0, 0].isinf().sum() == 1  # in the reasoning only the stop token is refused (JSON must come)
    chain = Masks(guides)  # a draft chain: its first link is masked, the links after it are not
    links = torch.zeros(2, len(guides), vocab)
    chain.apply(links[0])
    chain.apply(links[1])
    assert torch.equal(links[0].isinf(), logits[:, 0].isinf())
    assert not links[1].isinf().any()
    with pytest.raises(ValueError, match="cannot mask a row of 4"):
        Masks(guides, kept).apply(torch.zeros(len(guides), 4, vocab))


def assert_each_position_masked_alone(logits: torch.Tensor, guides: list[Guide | None], kept: list[list[int]]) -> None:
    """Verify logits [B, T, V] masked as each row's position j is alone after its first j drafts (unmasked past
    them)."""
    for b, (g, row) in enumerate(zip(guides, kept, strict=True)):
        for j in range(logits.shape[1]):
            expected = torch.zeros(1, logits.shape[-1])
            if g is not None and j <= len(row):
                assert all(g.accept(t) for t in row[:j])
                Masks([g]).apply(expected)
                g.rollback(j)
            assert torch.equal(logits[b, j].isinf(), expected[0].isinf()), (b, j)


def test_masks_filled_over_several_threads_equal_each_rows_own(
    models: tuple[Transformer, Transformer], grammars: Grammars, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A verify's masks filled over several threads (each filling its share of a position's rows) are every row's
    own at every position."""
    monkeypatch.setattr(masking, "_threads", masking._threads)  # restored after the test
    masking.set_fill_threads(3)
    tokenizer, dsml = load_tokenizer(), 128825
    texts = ['{"a": [1, 2]}', '{"b": "xy', "[true, null", '{"c": {"d": 3.5}}', "  [", '{"e"']
    guides: list[Guide | None] = []
    drafts: list[list[int]] = []
    for i in range(3 * masking.SHARE_ROWS + 2):
        text = tokenizer.encode_plain(texts[i % len(texts)])
        if i % 5 == 4:
            guides.append(None if i % 2 else Guide(None, banned=[dsml, 7 + i]))
        else:
            g = guide(grammars, decode_pb2.OutputConstraint(json_object=True), banned=[dsml])
            assert all(g.follow(t) for t in text[: i % 3])
            guides.append(g)
        drafts.append(text[i % 3 : i % 3 + 3])
    kept = [row[:n] for row, n in zip(drafts, admitted(guides, drafts), strict=True)]
    assert len({len(row) for row in kept}) > 1  # rows stop at different drafts
    logits = torch.zeros(len(guides), 4, models[1].args.vocab_size)
    Masks(guides, kept).apply(logits)
    assert_each_position_masked_alone(logits, guides, kept)
