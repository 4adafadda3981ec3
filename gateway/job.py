"""An API request made ready for the mesh: converted by the recipe, rendered to token ids, its output budget
resolved against the model's context, its cache salt and conversation key computed. Everything wrong with a
request is found here, before it takes an admission slot.

Both steps run on the gateway's worker threads (gateway/workers.py): `convert` (the body's JSON, the API's
rules, the salt, the output constraint) needs no replica; `job` renders and tokenises against the served model's
context, so an over-long prompt is refused as soon as its count passes the room it has, not after encoding all
of it.
"""

from __future__ import annotations

import hashlib
import os

import msgspec

from gateway.affinity import AffinityKey
from gateway.api_rules import check_request
from gateway.constraint import output_constraint
from gateway.errors import GatewayError, Kind
from mesh.block_keys import block_keys
from proto.decode.v1 import decode_pb2
from recipe import (
    Api,
    Conversation,
    ConversionOptions,
    ConvertedRequest,
    ModelVersion,
    PromptTooLongError,
    RecipeError,
    Tokenizer,
    User,
    convert,
    render,
)

MAX_SALT_CHARS = 256


class Model(msgspec.Struct, frozen=True):
    """What requests need to know about the served model (from a replica's GetModelInfo)."""

    fingerprint: bytes
    block_tokens: int
    layout_version: int
    max_context: int

    @property
    def system_fingerprint(self) -> str:
        return "fp_" + self.fingerprint.hex()[:16]


class Job(msgspec.Struct, frozen=True):
    """One request, ready to generate.

    request: the recipe's conversion (sampling, parsing options, the API's response settings).
    token_ids: the rendered prompt.
    max_tokens: the output budget sent to decode.
    salt: the block-key salt (the request's `cache_salt`; random when prefix reuse is off).
    affinity: the conversation key the router uses.
    constraint: what decode masks the answer to (gateway/constraint.py).
    """

    request_id: str
    request: ConvertedRequest
    token_ids: list[int]
    max_tokens: int
    salt: bytes
    affinity: AffinityKey
    constraint: decode_pb2.OutputConstraint

    @property
    def api(self) -> Api:
        return self.request.api


class Converted(msgspec.Struct, frozen=True):
    """A request body converted: what it asks, its block-key salt, its output constraint."""

    request: ConvertedRequest
    salt: bytes
    constraint: decode_pb2.OutputConstraint


class _Extras(msgspec.Struct):
    """Request fields the recipe does not read. `cache_salt` isolates a tenant's prefix cache (as in vLLM)."""

    cache_salt: str | None = None


class Codec:
    """Turns API request bodies into jobs for the served model."""

    def __init__(self, tokenizer: Tokenizer, *, model_name: str, max_output_tokens: int, prefix_reuse: bool) -> None:
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_output_tokens = max_output_tokens
        self.prefix_reuse = prefix_reuse
        aliases = {model_name: ModelVersion.V41} if model_name != ModelVersion.V41.value else {}
        budgets = {"thinking_max_tokens": max_output_tokens, "non_thinking_max_tokens": max_output_tokens}
        self.options = ConversionOptions(
            versions=(ModelVersion.V41,),  # the official name of what is served, never another's
            responses_chain="resolved",  # gateway/chains.py splices the previous response into `input`
            model_aliases=aliases,
            **(budgets if max_output_tokens else {}),
        )

    @property
    def model_names(self) -> tuple[str, ...]:
        """The names requests may use: the served name and the official name of its encoding."""
        return tuple(dict.fromkeys((self.model_name, ModelVersion.V41.value)))

    def convert(self, api: Api, body: bytes) -> Converted:
        """Convert one request body for generation; GatewayError (400) naming what is wrong with it."""
        request = self._convert(api, body, generation=True)
        return Converted(request, self._salt(body), output_constraint(request, self.tokenizer))

    def count_tokens(self, api: Api, body: bytes) -> int:
        """The length of the prompt a request renders to (no budget: counting needs none); GatewayError (400)."""
        request = self._convert(api, body, generation=False)
        return len(render(request.conversation, request.version, self.tokenizer).token_ids or ())

    def job(self, converted: Converted, model: Model, *, request_id: str, session: str | None) -> Job:
        """The job: the prompt rendered and its output budget resolved against the model's context (400 once the
        prompt is known to leave no room for the requested budget, or for any when none is requested)."""
        request = converted.request
        try:
            prompt = render(
                request.conversation,
                request.version,
                self.tokenizer,
                token_limit=request.prompt_limit(model.max_context),
            )
            token_ids = prompt.token_ids or []
            max_tokens = request.resolve_max_tokens(len(token_ids), model.max_context)
        except PromptTooLongError as over:
            error = request.context_error(over.tokens, model.max_context, at_least=True)
            raise GatewayError.from_recipe(error) from None
        except RecipeError as error:
            raise GatewayError.from_recipe(error) from None
        if self.max_output_tokens:
            max_tokens = min(max_tokens, self.max_output_tokens)
        keys = block_keys(
            token_ids,
            block_tokens=model.block_tokens,
            fingerprint=model.fingerprint,
            salt=converted.salt,
            layout_version=model.layout_version,
        )
        affinity = AffinityKey(session, tuple(keys), opening(request.conversation, converted.salt))
        return Job(request_id, request, token_ids, max_tokens, converted.salt, affinity, converted.constraint)

    def _convert(self, api: Api, body: bytes, *, generation: bool) -> ConvertedRequest:
        try:
            request = convert(api, body, self.options)
        except RecipeError as error:
            raise GatewayError.from_recipe(error) from None
        check_request(request, generation=generation)
        return request

    def _salt(self, body: bytes) -> bytes:
        if not self.prefix_reuse:
            return os.urandom(16)
        try:
            salt = msgspec.json.decode(body, type=_Extras).cache_salt or ""
        except msgspec.ValidationError as exc:
            raise GatewayError(Kind.BAD_REQUEST, f"Invalid request: {exc}", param="cache_salt") from None
        if len(salt) > MAX_SALT_CHARS:
            message = f"cache_salt is longer than {MAX_SALT_CHARS} characters"
            raise GatewayError(Kind.BAD_REQUEST, message, param="cache_salt")
        return salt.encode()


def opening(conversation: Conversation, salt: bytes) -> bytes | None:
    """The digest of what every turn of a conversation sends again: its messages up to its first user message (a
    system prompt and the task), with the cache salt; None without a user message. Later turns only append."""
    messages = conversation.messages
    first_user = next((i for i, message in enumerate(messages) if isinstance(message, User)), None)
    if first_user is None:
        return None
    encoded = msgspec.json.encode((salt, messages[: first_user + 1]))
    return hashlib.blake2b(encoded, digest_size=16).digest()
