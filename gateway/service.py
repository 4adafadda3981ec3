"""What the HTTP and gRPC faces share: authorise, size-check, prepare, admit and open a request.

    key check (401) → body size (413) → a Responses chain resolved (400 previous_response_not_found) → recipe
    conversion (400) → the model known (503) → render within the model's context (400) → admission slot (429) →
    prefill + first decode message (503 / 429) → a `Reply` the face streams or completes → a finished Responses
    turn kept (gateway/chains.py) before its terminal event leaves

Conversion and rendering run on the worker threads (gateway/workers.py), never on the event loop.

Nothing is sent to the client before the first decode message, so every failure up to there is a clean HTTP
status (or gRPC code) with the API's error body.
"""

from __future__ import annotations

import asyncio
import functools
import hmac
import time
import uuid
from collections.abc import Mapping

import grpc

from gateway import chains
from gateway.admission import Admission, Ticket
from gateway.backends import Backends
from gateway.errors import GatewayError, Kind
from gateway.job import Codec, Model
from gateway.metrics import GatewayMetrics
from gateway.replicas import ReplicaState
from gateway.reply import Reply
from gateway.response_store import ResponseStore, Turn
from gateway.workers import Workers
from mesh.logging import get_logger
from proto.mesh.v1 import model_info_pb2
from recipe import Api

MODEL_INFO_TIMEOUT_S = 2.0
MAX_REQUEST_ID_CHARS = 128

log = get_logger("gateway")


def request_id(given: str | None) -> str:
    """The client's request id if it is a sane one, else a new one."""
    if given and len(given) <= MAX_REQUEST_ID_CHARS and given.isascii() and given.isprintable():
        return given
    return "req_" + uuid.uuid4().hex


def presented_key(headers: Mapping[str, str]) -> str | None:
    """The API key a request carries: OpenAI's `Authorization: Bearer`, Anthropic's `x-api-key`."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip()
    return headers.get("x-api-key")


class Gateway:
    def __init__(
        self,
        codec: Codec,
        backends: Backends,
        admission: Admission,
        workers: Workers,
        metrics: GatewayMetrics,
        store: ResponseStore,
        *,
        api_key: str,
        max_body_bytes: int,
    ) -> None:
        self.codec = codec
        self.store = store
        self.backends = backends
        self.admission = admission
        self.workers = workers
        self.metrics = metrics
        self.max_body_bytes = max_body_bytes
        self._api_key = api_key.encode()
        self._model: Model | None = None
        self._model_lock = asyncio.Lock()

    @property
    def draining(self) -> bool:
        return self.admission.draining

    @property
    def api_key_required(self) -> bool:
        return bool(self._api_key)

    @property
    def model_known(self) -> bool:
        return self._model is not None

    def authorize(self, presented: str | None) -> None:
        if self._api_key and not (presented and hmac.compare_digest(presented.encode(), self._api_key)):
            why = "No API key was provided" if not presented else "The API key is not valid"
            raise GatewayError(Kind.UNAUTHORIZED, f"{why}. Send it as `Authorization: Bearer <key>` or `x-api-key`.")

    def check_size(self, size: int) -> None:
        if size > self.max_body_bytes:
            raise GatewayError(
                Kind.TOO_LARGE, f"The request body has {size} bytes; the limit is {self.max_body_bytes} bytes."
            )

    async def model(self) -> Model:
        """The served model's block-key parameters and context, asked of the replicas once."""
        if self._model is None:
            async with self._model_lock:
                if self._model is None:
                    self._model = await self._fetch_model()
        return self._model

    async def _fetch_model(self) -> Model:
        """Every prefill and decode replica is asked at once; the first answer describes the model. Decode replicas
        answer too, so a mesh whose prefill replicas are all down still serves (through decode's fallback)."""
        asks = {
            asyncio.ensure_future(_describe(role, state))
            for role, pool in self.backends.router.pools.items()
            for state in pool.states()
        }
        errors = []
        try:
            while asks:
                done, asks = await asyncio.wait(asks, return_when=asyncio.FIRST_COMPLETED)
                for answer in (task.result() for task in done):
                    if isinstance(answer, str):
                        errors.append(answer)
                        continue
                    model = Model(
                        bytes(answer.fingerprint), answer.kv_block_tokens, answer.layout_version, answer.max_context
                    )
                    log.info("model_info", model=answer.model, fingerprint=model.fingerprint.hex(),
                             max_context=model.max_context, block_tokens=model.block_tokens,
                             vocab_size=answer.vocab_size)  # fmt: skip
                    return model
        finally:
            for task in asks:
                task.cancel()
        raise GatewayError(
            Kind.UNAVAILABLE,
            f"The model is not known yet: no replica answered GetModelInfo ({'; '.join(sorted(errors)) or 'none'}).",
        )

    async def open(
        self,
        api: Api,
        body: bytes,
        *,
        api_key: str | None,
        request_id: str,
        session: str | None,
        local: dict[str, Turn] | None = None,
    ) -> tuple[Reply, Ticket]:
        """An opened reply and the admission slot it holds (release both with `close`); GatewayError if refused.
        `local`: a connection's memory of its latest Responses turn (WebSocket), searched before the store and
        given each finished turn."""
        arrived = time.monotonic()
        chain = None
        try:
            self.authorize(api_key)
            self.check_size(len(body))
            if api == "responses":
                chain = await self.chain(body, local or {})
                body = chain.body
            converted = await self.workers.run(len(body), self.codec.convert, api, body)
            model = await self.model()
            prepare = functools.partial(self.codec.job, request_id=request_id, session=session)
            job = await self.workers.run(len(body), prepare, converted, model)
            ticket = await self.admission.enter()
        except GatewayError as error:
            self.refused(api, error)
            raise
        keep = None if chain is None else functools.partial(self._keep, chain, local)
        reply = Reply(job, self.backends, self.codec.tokenizer, model, arrived, keep)
        if chain is not None and chain.previous is not None:
            reused = chains.reused_tokens(chain.previous, job.token_ids)
            self.metrics.previous_response_reuse.inc(reused)
            log.info("response_continued", request_id=request_id, previous=chain.previous.id,
                     prompt_tokens=len(job.token_ids), reused_tokens=reused)  # fmt: skip
        try:
            await reply.open()
        except BaseException:
            self.close(reply, ticket)
            raise
        ticket.started()  # every choice has its first decode message: the request is in service
        return reply, ticket

    async def chain(self, body: bytes, local: dict[str, Turn]) -> chains.Chain:
        """A Responses body with its `previous_response_id` resolved (400 previous_response_not_found)."""
        request = await self.workers.run(len(body), chains.read, body)
        previous_id = request.fields.previous_response_id if request.fields else None
        if previous_id is None:
            return chains.spliced(request, None)
        previous, source = await chains.find(self.store, previous_id, local)
        self.metrics.responses_continued.labels(source).inc()
        return await self.workers.run(len(body), chains.spliced, request, previous)

    async def _keep(self, chain: chains.Chain, local: dict[str, Turn] | None, reply: Reply) -> None:
        """A finished Responses turn: the connection's latest (when there is a connection), and stored unless the
        request said `store: false`."""
        turn = chain.turn(reply.choices.response(), reply.job.salt, [*reply.job.token_ids, *reply.output_ids])
        if local is not None:
            local.clear()
            local[turn.id] = turn
        if chain.store:
            await self.store.put(turn)
            self.metrics.responses_stored.inc()

    async def count_tokens(self, body: bytes, *, api_key: str | None) -> int:
        """Input tokens of an Anthropic Messages request as this model reads it (system, tools and the generation
        header included): the rendered prompt's length. Needs no replica: the tokenizer is the gateway's own."""
        try:
            self.authorize(api_key)
            self.check_size(len(body))
            return await self.workers.run(len(body), self.codec.count_tokens, "messages", body)
        except GatewayError as error:
            self.refused("messages", error)
            raise

    def refused(self, api: Api, error: GatewayError) -> None:
        """Count a request turned away before it had a reply."""
        self.metrics.errors.labels(error.kind.label).inc()
        self.metrics.requests.labels(api, "error").inc()
        log.info("request_refused", api=api, kind=error.kind.label, error=error.message)

    @staticmethod
    def close(reply: Reply, ticket: Ticket) -> None:
        reply.close()
        ticket.release()


async def _describe(role: str, state: ReplicaState) -> model_info_pb2.ModelInfo | str:
    """A replica's GetModelInfo answer, or why there is none."""
    try:
        return await state.stub.GetModelInfo(model_info_pb2.GetModelInfoRequest(), timeout=MODEL_INFO_TIMEOUT_S)
    except grpc.aio.AioRpcError as exc:
        return f"{role} {state.name}: {exc.code().name}"
