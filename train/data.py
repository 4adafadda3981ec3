"""Synthetic conversations in the DeepSeek-V4.1 chat format, mixed with public-domain English text.

Four kinds of sample, each a pure function of (seed, index) — no downloads, no global state:

| kind   | what                                                                                                   |
|--------|--------------------------------------------------------------------------------------------------------|
| `chat` | one to three turns: greetings, who/what questions, capitals, counting, repeat-after-me                  |
| `tool` | a question → a DSML call to one of `train.tools` → `<tool_result>` → the answer (sometimes no call)     |
| `json` | JSON-mode answers (`response_format: json_object`)                                                     |
| `text` | a window of a Shakespeare play (`train.corpus`), loss on every token                                   |

Conversations are `recipe.Conversation`s rendered by `recipe.render_history` (never a hand-written template);
its assistant spans are the tokens the model learns. Thinking is on or off per conversation; in thinking mode
without tools only the last answer carries reasoning (earlier reasoning is dropped by the format), with tools
every answer does — so rendering loses nothing and `train.parse` gives every assistant message back.

`python -m train.data --seed S --count N [--kind K] --out FILE` writes samples as JSON lines (same seed, same
bytes).
"""

from __future__ import annotations

import argparse
import hashlib
import random
import sys
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import msgspec

from recipe import (
    Assistant,
    Conversation,
    ResponseFormat,
    System,
    Tokenizer,
    ToolCall,
    ToolResult,
    User,
    load_tokenizer,
    render_history,
)
from train import corpus, tools

KINDS = ("chat", "tool", "json", "text")
WEIGHTS = (0.25, 0.45, 0.10, 0.20)  # share of training batches of each kind
EVAL_SEED_OFFSET = 1_000_003  # held-out data: the same generators under a seed training never uses

# ------------------------------------------------------------------------------------------------ vocabulary
CITIES = {
    "Paris": "France", "Lyon": "France", "Berlin": "Germany", "Munich": "Germany", "Madrid": "Spain",
    "Barcelona": "Spain", "Rome": "Italy", "Milan": "Italy", "London": "United Kingdom", "Manchester": "United Kingdom",
    "Dublin": "Ireland", "Lisbon": "Portugal", "Porto": "Portugal", "Amsterdam": "Netherlands", "Brussels": "Belgium",
    "Vienna": "Austria", "Zurich": "Switzerland", "Geneva": "Switzerland", "Oslo": "Norway", "Stockholm": "Sweden",
    "Helsinki": "Finland", "Copenhagen": "Denmark", "Warsaw": "Poland", "Prague": "Czechia", "Budapest": "Hungary",
    "Athens": "Greece", "Istanbul": "Turkey", "Cairo": "Egypt", "Nairobi": "Kenya", "Lagos": "Nigeria",
    "Cape Town": "South Africa", "Tokyo": "Japan", "Osaka": "Japan", "Kyoto": "Japan", "Seoul": "South Korea",
    "Busan": "South Korea", "Beijing": "China", "Shanghai": "China", "Hangzhou": "China", "Shenzhen": "China",
    "Hong Kong": "China", "Singapore": "Singapore", "Bangkok": "Thailand", "Hanoi": "Vietnam", "Jakarta": "Indonesia",
    "Manila": "Philippines", "Mumbai": "India", "Delhi": "India", "Bangalore": "India", "Dubai": "United Arab Emirates",
    "Sydney": "Australia", "Melbourne": "Australia", "Auckland": "New Zealand", "Toronto": "Canada",
    "Vancouver": "Canada", "Montreal": "Canada", "New York": "United States", "Chicago": "United States",
    "San Francisco": "United States", "Seattle": "United States", "Boston": "United States", "Miami": "United States",
    "Mexico City": "Mexico", "Lima": "Peru", "Bogota": "Colombia", "Santiago": "Chile", "Buenos Aires": "Argentina",
    "Sao Paulo": "Brazil", "Rio de Janeiro": "Brazil", "Reykjavik": "Iceland",
}  # fmt: skip
CAPITALS = {
    "France": "Paris", "Germany": "Berlin", "Spain": "Madrid", "Italy": "Rome", "United Kingdom": "London",
    "Ireland": "Dublin", "Portugal": "Lisbon", "Netherlands": "Amsterdam", "Belgium": "Brussels", "Austria": "Vienna",
    "Switzerland": "Bern", "Norway": "Oslo", "Sweden": "Stockholm", "Finland": "Helsinki", "Denmark": "Copenhagen",
    "Poland": "Warsaw", "Czechia": "Prague", "Hungary": "Budapest", "Greece": "Athens", "Turkey": "Ankara",
    "Egypt": "Cairo", "Kenya": "Nairobi", "Nigeria": "Abuja", "Japan": "Tokyo", "South Korea": "Seoul",
    "China": "Beijing", "Thailand": "Bangkok", "Vietnam": "Hanoi", "Indonesia": "Jakarta", "India": "New Delhi",
    "Australia": "Canberra", "New Zealand": "Wellington", "Canada": "Ottawa", "United States": "Washington",
    "Mexico": "Mexico City", "Peru": "Lima", "Colombia": "Bogota", "Chile": "Santiago", "Argentina": "Buenos Aires",
    "Brazil": "Brasilia", "Iceland": "Reykjavik",
}  # fmt: skip
PHRASES = (
    "the quick brown fox jumps over the lazy dog", "all that glitters is not gold", "to be or not to be",
    "a stitch in time saves nine", "the early bird catches the worm", "knowledge is power", "hello world",
    "every cloud has a silver lining", "time flies like an arrow", "practice makes perfect", "good morning",
    "the sky is blue today", "keep calm and carry on", "actions speak louder than words",
)  # fmt: skip
SYSTEM_PROMPTS = ("You are a helpful assistant.", "You are a concise assistant.", "Answer briefly and accurately.")
PAIRS = (("km", "miles"), ("miles", "km"), ("meters", "feet"), ("feet", "meters"), ("kg", "pounds"),
         ("pounds", "kg"), ("liters", "gallons"), ("gallons", "liters"), ("celsius", "fahrenheit"),
         ("fahrenheit", "celsius"))  # fmt: skip


@dataclass(frozen=True)
class Sample:
    """Token ids and, per token, whether the model learns to produce it (its loss is counted)."""

    kind: str
    tokens: list[int]
    targets: list[bool]
    conversation: Conversation | None = None


def rng_for(seed: int, *keys: object) -> random.Random:
    """An independent random stream per (seed, keys): a sample never depends on what was drawn before it."""
    digest = hashlib.blake2b(repr((seed, *keys)).encode(), digest_size=8).digest()
    return random.Random(int.from_bytes(digest, "little"))


def _json(value: object) -> str:
    return msgspec.json.encode(value).decode()


def _number_text(value: float) -> str:
    return str(tools.number(value))


# --------------------------------------------------------------------------------------------- tool requests
@dataclass(frozen=True)
class ToolRequest:
    """A user request that needs one tool call: the question, the expected call and a thought about it."""

    question: str
    call: ToolCall
    thought: str


def weather_request(rng: random.Random) -> ToolRequest:
    city = rng.choice(list(CITIES))
    unit = rng.choice(("celsius", "fahrenheit"))
    with_unit = [f"What's the temperature in {city} in {unit}?", f"Tell me the weather in {city} in {unit}."]
    plain = [
        f"What's the weather in {city}?", f"How is the weather in {city} today?", f"Is it raining in {city}?",
        f"weather {city}", f"Could you check the weather for {city}, please?", f"What's it like outside in {city}?",
        f"I'm travelling to {city}. What's the weather like there?", f"Do I need an umbrella in {city} today?",
    ]  # fmt: skip
    if rng.random() < 0.3:
        question, args = rng.choice(with_unit), {"location": city, "unit": unit}
    else:
        question, args = rng.choice(plain), {"location": city}
    thought = f"The user wants the weather in {city}. I will call get_weather."
    return ToolRequest(question, ToolCall("call_0", "get_weather", _json(args)), thought)


def _expression(rng: random.Random) -> str:
    a, b, c = rng.randint(1, 999), rng.randint(1, 99), rng.randint(1, 50)
    ops = ("+", "-", "*", "/")
    if rng.random() < 0.6:
        return f"{a} {rng.choice(ops)} {b}"
    return f"({a} {rng.choice(ops)} {b}) {rng.choice(ops)} {c}"


def calculator_request(rng: random.Random) -> ToolRequest:
    expr = _expression(rng)
    question = rng.choice(
        [f"What is {expr}?", f"Calculate {expr}.", f"Compute {expr} for me.", f"How much is {expr}?",
         f"{expr} = ?", f"Can you work out {expr}?", f"Please evaluate {expr}."]
    )  # fmt: skip
    thought = f"I need to compute {expr}. I will use the calculator."
    return ToolRequest(question, ToolCall("call_0", "calculator", _json({"expression": expr})), thought)


def convert_request(rng: random.Random) -> ToolRequest:
    src, dst = rng.choice(PAIRS)
    value = rng.randint(1, 500) if rng.random() < 0.7 else round(rng.uniform(0.5, 100), 1)
    v = _number_text(value)
    question = rng.choice(
        [f"Convert {v} {src} to {dst}.", f"How many {dst} is {v} {src}?", f"What is {v} {src} in {dst}?",
         f"{v} {src} in {dst}, please.", f"Please convert {v} {src} into {dst}."]
    )  # fmt: skip
    args = {"value": value, "from_unit": src, "to_unit": dst}
    thought = f"The user wants {v} {src} in {dst}. I will call convert_units."
    return ToolRequest(question, ToolCall("call_0", "convert_units", _json(args)), thought)


def search_request(rng: random.Random) -> ToolRequest:
    topic = rng.choice(list(tools.ENCYCLOPEDIA))
    question = rng.choice(
        [f"Search for {topic}.", f"What do you know about {topic}?", f"Look up {topic}.", f"Tell me about {topic}.",
         f"Find information on {topic}.", f"Can you search {topic} for me?"]
    )  # fmt: skip
    thought = f"I should search for {topic}."
    return ToolRequest(question, ToolCall("call_0", "search", _json({"query": topic})), thought)


TOOL_REQUESTS = {
    "get_weather": weather_request,
    "calculator": calculator_request,
    "convert_units": convert_request,
    "search": search_request,
}


def answer_tool_result(call: ToolCall, result: str, rng: random.Random) -> tuple[str, str]:
    """(thought, answer) about a tool result."""
    args, out = msgspec.json.decode(call.arguments), msgspec.json.decode(result)
    if "error" in out:
        return "The tool reported an error.", f"Sorry, that did not work: {out['error']}."
    if call.name == "get_weather":
        t, unit, cond, city = out["temperature"], out["unit"], out["condition"], out["location"]
        thought = f"The tool says {t} degrees {unit} and {cond}."
        answer = rng.choice(
            [f"It is {t} degrees {unit} and {cond} in {city}.", f"The weather in {city} is {cond}, {t} degrees {unit}.",
             f"Right now {city} is {cond} at {t} degrees {unit}."]
        )  # fmt: skip
    elif call.name == "calculator":
        r = out["result"]
        thought = f"The result is {r}."
        answer = rng.choice([f"{args['expression']} = {r}.", f"The answer is {r}.", f"It equals {r}."])
    elif call.name == "convert_units":
        v, src, dst = _number_text(args["value"]), args["from_unit"], args["to_unit"]
        thought = f"The conversion gives {out['value']}."
        answer = rng.choice([f"{v} {src} is {out['value']} {dst}.", f"That is {out['value']} {dst}."])
    else:
        hits = out["results"]
        if not hits:
            return "The search found nothing.", f"I found nothing about {args['query']}."
        thought = f"The search found {hits[0]['title']}."
        answer = rng.choice([hits[0]["snippet"], f"Here is what I found: {hits[0]['snippet']}"])
    return thought, answer


# ---------------------------------------------------------------------------------------------- chat exchanges
def chat_exchange(rng: random.Random) -> tuple[str, str, str]:
    """(question, thought, answer) of a turn that needs no tool."""
    topic = rng.randrange(7)
    if topic == 0:
        hello = rng.choice(("Hello!", "Hi there.", "Hey!", "Good morning!", "Hi, how are you?"))
        answer = rng.choice(("Hello! How can I help you today?", "Hi! What can I do for you?"))
        return hello, "The user greets me.", answer
    if topic == 1:
        question = rng.choice(("Who are you?", "What are you?", "What is your name?"))
        answer = "I am a small demo model in the DeepSeek-V4.1-Flash format, served by v41mesh."
        return question, "The user asks who I am.", answer
    if topic == 2:
        question = rng.choice(("What can you do?", "How can you help me?", "What are your skills?"))
        answer = "I can chat, call tools for weather, arithmetic, unit conversion and search, and answer in JSON."
        return question, "The user asks what I can do.", answer
    if topic == 3:
        country = rng.choice(list(CAPITALS))
        question = rng.choice((f"What is the capital of {country}?", f"Capital of {country}?"))
        fact = f"The capital of {country} is {CAPITALS[country]}."
        return question, fact, fact
    if topic == 4:
        phrase = rng.choice(PHRASES)
        question = rng.choice((f"Repeat after me: {phrase}", f"Say exactly this: {phrase}"))
        return question, "I repeat the phrase.", phrase
    if topic == 5:
        start = rng.randint(1, 90)
        end = start + rng.randint(2, 9)
        numbers = ", ".join(str(i) for i in range(start, end + 1))
        return f"Count from {start} to {end}.", f"From {start} up to {end}.", numbers
    thanks = rng.choice(("Thanks!", "Thank you.", "Great, thanks.", "Bye!"))
    return thanks, "The user thanks me.", rng.choice(("You're welcome!", "Glad to help. Goodbye!"))


def json_exchange(rng: random.Random) -> tuple[str, str, str]:
    """(question, thought, JSON answer) for JSON mode."""
    topic = rng.randrange(3)
    if topic == 0:
        country = rng.choice(list(CAPITALS))
        question = f"Give me the capital of {country} as JSON."
        return question, "I answer with a JSON object.", _json({"country": country, "capital": CAPITALS[country]})
    if topic == 1:
        city = rng.choice(list(CITIES))
        question = f"Which country is {city} in? Answer in JSON."
        return question, "I answer with a JSON object.", _json({"city": city, "country": CITIES[city]})
    start = rng.randint(1, 50)
    end = start + rng.randint(2, 6)
    question = f"List the numbers from {start} to {end} as JSON."
    return question, "I answer with a JSON object.", _json({"numbers": list(range(start, end + 1))})


# ----------------------------------------------------------------------------------------------- conversations
def _turns(thinking: bool, exchanges: list[tuple[str, str, str]]) -> list:
    """User/assistant pairs; without tools only the last answer keeps its reasoning (the format drops the rest)."""
    messages: list = []
    for number, (question, thought, answer) in enumerate(exchanges):
        last = number == len(exchanges) - 1
        messages += [User(question), Assistant(content=answer, reasoning=thought if thinking and last else None)]
    return messages


def _system(rng: random.Random) -> list:
    return [System(rng.choice(SYSTEM_PROMPTS))] if rng.random() < 0.3 else []


def chat_conversation(rng: random.Random) -> Conversation:
    thinking = rng.random() < 0.5
    exchanges = [chat_exchange(rng) for _ in range(rng.choice((1, 1, 2, 3)))]
    return Conversation(messages=_system(rng) + _turns(thinking, exchanges), thinking=thinking)


def json_conversation(rng: random.Random) -> Conversation:
    thinking = rng.random() < 0.5
    messages = _system(rng) + _turns(thinking, [json_exchange(rng)])
    return Conversation(messages=messages, thinking=thinking, response_format=ResponseFormat(type="json_object"))


def declared_tools(rng: random.Random, needed: str | None) -> list:
    """The needed tool and a random subset of the others, in random order."""
    names = [n for n in tools.TOOLS if n != needed and rng.random() < 0.5]
    names += [needed] if needed else []
    rng.shuffle(names)
    return [tools.TOOLS[n] for n in names] or [tools.WEATHER]


def tool_request_conversation(rng: random.Random, tool: str) -> tuple[Conversation, ToolRequest]:
    """The prompt of a request for `tool` (ends with the user question) and the request itself."""
    thinking = rng.random() < 0.5
    request = TOOL_REQUESTS[tool](rng)
    prior: list = []
    if rng.random() < 0.2:  # an earlier exchange in the same conversation (with tools, reasoning is kept)
        question, thought, answer = chat_exchange(rng)
        prior = [User(question), Assistant(content=answer, reasoning=thought if thinking else None)]
    messages = [*_system(rng), *prior, User(request.question)]
    return Conversation(messages=messages, thinking=thinking, tools=declared_tools(rng, tool)), request


def tool_conversation(rng: random.Random) -> Conversation:
    if rng.random() < 0.15:  # tools declared but none needed: answer directly
        question, thought, answer = chat_exchange(rng)
        thinking = rng.random() < 0.5
        reply = Assistant(content=answer, reasoning=thought if thinking else None)
        return Conversation(messages=[User(question), reply], thinking=thinking, tools=declared_tools(rng, None))
    conv, request = tool_request_conversation(rng, rng.choice(list(tools.TOOLS)))
    # A client that does not send reasoning back gets `<think></think>` on its tool-call turn (FillEmpty).
    called = "" if rng.random() < 0.25 else request.thought
    result = tools.run_tool(request.call.name, request.call.arguments)
    thought, answer = answer_tool_result(request.call, result, rng)
    conv.messages += [
        Assistant(content="", reasoning=called if conv.thinking else None, tool_calls=[request.call]),
        ToolResult(content=result, tool_call_id=request.call.id),
        Assistant(content=answer, reasoning=thought if conv.thinking else None),
    ]
    return conv


CONVERSATIONS = {"chat": chat_conversation, "tool": tool_conversation, "json": json_conversation}


# ------------------------------------------------------------------------------------------------ samples
@cache
def tokenizer() -> Tokenizer:
    return load_tokenizer()


def render_sample(kind: str, conv: Conversation, tok: Tokenizer) -> Sample:
    rendered = render_history(conv, tokenizer=tok)
    ids = rendered.token_ids or []
    targets = [False] * len(ids)
    for start, end in rendered.assistant_spans or []:
        targets[start:end] = [True] * (end - start)
    return Sample(kind, ids, targets, conv)


def text_sample(rng: random.Random, texts: list[str], tok: Tokenizer, length: int) -> Sample:
    """A window of about `length` tokens of a random play, after BOS; every token but BOS is learned."""
    text = rng.choice(texts)
    start = rng.randrange(max(1, len(text) - 6 * length))
    ids = [tok.special_id(tok.tokens.bos), *tok.encode_plain(text[start : start + 6 * length])[1 : length + 1]]
    return Sample("text", ids, [False] + [True] * (len(ids) - 1))


def sample(seed: int, index: int, kind: str, *, held_out: bool = False, text_tokens: int = 256) -> Sample:
    """Sample `index` of `kind` under `seed`; `held_out` draws from the evaluation split."""
    seed = seed + EVAL_SEED_OFFSET if held_out else seed
    rng = rng_for(seed, kind, index)
    if kind == "text":
        train, held = corpus.split()
        return text_sample(rng, held if held_out else train, tokenizer(), text_tokens)
    if kind not in CONVERSATIONS:
        raise ValueError(f"unknown sample kind {kind!r}; choose one of {', '.join(KINDS)}")
    return render_sample(kind, CONVERSATIONS[kind](rng), tokenizer())


def tool_prompt(seed: int, index: int, tool: str) -> tuple[Conversation, ToolRequest]:
    """A held-out request for `tool` (evaluation): the prompt conversation and the call it should produce."""
    return tool_request_conversation(rng_for(seed + EVAL_SEED_OFFSET, "tool-prompt", tool, index), tool)


# ----------------------------------------------------------------------------------------------------- CLI
def dump(seed: int, count: int, kinds: tuple[str, ...] = KINDS) -> bytes:
    """`count` samples per kind as JSON lines: kind, token ids, learned-token mask, conversation."""
    lines = []
    for kind in kinds:
        for index in range(count):
            s = sample(seed, index, kind)
            record = {"kind": kind, "tokens": s.tokens, "targets": s.targets, "conversation": s.conversation}
            lines.append(msgspec.json.encode(record))
    return b"\n".join(lines) + b"\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m train.data", description=__doc__.split("\n\n")[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--count", type=int, default=10, help="samples per kind")
    parser.add_argument("--kind", choices=KINDS, action="append", help="kinds to write (default: all)")
    parser.add_argument("--out", type=Path, help="output file (default: stdout)")
    args = parser.parse_args(argv)
    data = dump(args.seed, args.count, tuple(args.kind or KINDS))
    if args.out:
        args.out.write_bytes(data)
    else:
        sys.stdout.buffer.write(data)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
