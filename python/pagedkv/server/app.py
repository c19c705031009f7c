"""The ASGI app: OpenAI's endpoints, ``/health``, ``/metrics``, tokenization, auth, errors.

    app = pagedkv.server.create_app(EngineArgs(num_blocks=512))   # or create_app(engine=AsyncLLM(...))
    uvicorn.run(app, host="127.0.0.1", port=8000)                 # what `pagedkv serve` does

``create_app()`` with no arguments serves the embedded SmolLM2 (``uvicorn --factory
pagedkv.server:create_app``). The engine is built when the app is, so a mounted app works
without lifespan events; an app that built its engine shuts it down (and closes the KV event
publisher) in its lifespan's end, or when :meth:`ServerState.close` is called.

Endpoints: ``POST /v1/completions``, ``POST /v1/chat/completions``, ``GET /v1/models``,
``GET /health`` (200 while the engine runs, else 503), ``GET /metrics`` (Prometheus),
``POST /tokenize``, ``POST /detokenize``, ``POST /reset_prefix_cache``, ``GET /kv_cache_info``
(block size, KV event endpoints and KV transfer role, for ``pagedkv router``), ``GET /version``,
``GET``/``POST /ping`` (vLLM's: ``/health``'s answer), ``GET /tokenizer_info`` (vLLM's: the
tokenizer's class, special tokens, ``model_max_length``, chat template); with
``PAGEDKV_SERVER_DEV_MODE=1``, ``POST /dev/check_invariants`` (the KV cache's bookkeeping
checked, and who holds blocks). ``/health`` is 503 when the engine is dead, or degraded: a
background thread that requests need (KV transfer, grammar compiles) died; its JSON body says
which (``AsyncLLM.health``).
``/v1/completions`` and ``/v1/chat/completions`` take ``kv_transfer_params`` on an engine with
``--kv-transfer-config`` (disaggregated prefill / decode; see pagedkv.distributed.connector).
With an API key, every path but ``/health``, ``/ping``, ``/metrics`` and ``/version`` needs
``Authorization: Bearer <key>``. Request bodies over ``ServerArgs.limits.max_request_body_bytes``
get 413 before they are read (pagedkv.server.body_limit); the other limits are in
pagedkv.server.limits. On start the app logs the model, its dtype and device, and the KV pool
(dtype, block size, blocks and bytes, tiers) and the limits it serves with.
"""

from __future__ import annotations

import hmac
import logging
import os
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.responses import Response

import pagedkv
from pagedkv.engine.args import EngineArgs
from pagedkv.engine.async_llm import AsyncLLM
from pagedkv.errors import ConfigError, PagedKVError
from pagedkv.kernels.layer_attention import describe_layers
from pagedkv.server.body_limit import BodySizeLimit
from pagedkv.server.chat import create_chat_completion, render_chat
from pagedkv.server.completions import create_completion
from pagedkv.server.dashboard import dashboard_html, encode_state
from pagedkv.server.errors import APIError, error_response, from_exception
from pagedkv.server.limits import ServerLimits
from pagedkv.server.metrics import ServerMetrics
from pagedkv.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    ModelCard,
    ModelList,
    TokenizeRequest,
)
from pagedkv.server.serving import OpenAIServing
from pagedkv.server.tokenizer_info import tokenizer_info
from pagedkv.server.tools import TOOL_CALL_PARSERS
from pagedkv.worker.cpu_linear import describe_cpu_kernels

__all__ = ["ServerArgs", "ServerState", "create_app"]

logger = logging.getLogger(__name__)

# Paths anyone may read when the server has an API key (load balancers, Prometheus).
# /dashboard is the page only (no data); its data, /dashboard/state, needs the key like the rest.
_OPEN_PATHS = frozenset({"/health", "/ping", "/metrics", "/version", "/dashboard"})
# Set to 1, the server also serves its development endpoints (/dev/...): checks for tests and
# the attack suite (tests/adversarial), never needed in production.
DEV_MODE_ENV = "PAGEDKV_SERVER_DEV_MODE"


@dataclass
class ServerArgs:
    """The server's own settings (the engine's are :class:`EngineArgs`).

    - ``served_model_names``: the names clients use in ``model`` (the first is reported);
      default: the model's id, or the embedded model's name.
    - ``api_key``: when set, requests need ``Authorization: Bearer <api_key>``.
    - ``max_queued_requests``: most requests admitted that have not produced a token yet;
      past it a request is answered 503 at once (``None``: no limit).
    - ``kv_events_endpoint``: ZMQ endpoint the KV-cache events are published on (e.g.
      ``tcp://127.0.0.1:5557``; ``None``: no events); ``kv_events_replay_endpoint``: the
      replay socket; ``dashboard_show_prompts``: ``/dashboard/state`` includes the start of each
      request's prompt text (off: ids and token counts only); ``kv_events_topic``: the topic frame; ``kv_events_buffer_steps``: batches
      kept for replay.
    - ``limits``: what one request or connection may ask for (:class:`ServerLimits`: body
      size, prompt characters, prompts per request, header timeout, connections, request chat
      templates).
    """

    served_model_names: list[str] = field(default_factory=list)
    api_key: str | None = None
    max_queued_requests: int | None = None
    kv_events_endpoint: str | None = None
    kv_events_replay_endpoint: str | None = None
    kv_events_topic: str = ""
    dashboard_show_prompts: bool = False
    kv_events_buffer_steps: int = 10_000
    limits: ServerLimits = field(default_factory=ServerLimits)
    # How chat outputs are parsed for tool calls (pagedkv.server.tools.TOOL_CALL_PARSERS).
    tool_call_parser: str = "hermes"

    def __post_init__(self) -> None:
        if self.tool_call_parser not in TOOL_CALL_PARSERS:
            raise ConfigError(f"tool_call_parser must be one of {TOOL_CALL_PARSERS}, got {self.tool_call_parser!r}")
        if isinstance(self.served_model_names, str):
            self.served_model_names = [self.served_model_names]
        if self.max_queued_requests is not None and (
            isinstance(self.max_queued_requests, bool)
            or not isinstance(self.max_queued_requests, int)
            or self.max_queued_requests < 1
        ):
            raise ConfigError(f"max_queued_requests must be a positive int, got {self.max_queued_requests!r}")
        if self.api_key is not None and not self.api_key:
            raise ConfigError("api_key must not be empty")
        if self.kv_events_replay_endpoint is not None and self.kv_events_endpoint is None:
            raise ConfigError("kv_events_replay_endpoint needs kv_events_endpoint")
        if not isinstance(self.limits, ServerLimits):
            raise ConfigError(f"limits must be a ServerLimits, got {type(self.limits).__name__}")


class ServerState:
    """What the app serves with: the engine, the shared serving state, the event publisher."""

    def __init__(self, engine: AsyncLLM, args: ServerArgs, *, owns_engine: bool, publisher: object | None) -> None:
        self.engine = engine
        self.args = args
        self.owns_engine = owns_engine
        self.publisher = publisher
        names = args.served_model_names or [_default_model_name(engine)]
        self.metrics = ServerMetrics(names[0], max_model_len=engine.engine.max_model_len)
        self.serving = OpenAIServing(
            engine, names, self.metrics, max_queued_requests=args.max_queued_requests, limits=args.limits
        )
        _log_startup(self)

    def close(self) -> None:
        """Shut the engine down (if the app built it: open streams end, every request is
        aborted and its blocks freed; the disk tier is flushed) and close the publisher after
        its last events."""
        if self.owns_engine and self.engine.is_running:
            self.engine.shutdown()
            stats = self.engine.engine.get_stats()  # the loop has stopped: read it directly
            logger.info(
                "the engine is shut down: %d requests unfinished, %d KV blocks in use",
                stats["num_unfinished_requests"],
                stats["num_used_blocks"],
            )
        if self.publisher is not None:
            self.engine.set_kv_event_sink(None)
            if not self.engine.is_running:
                # What the shutdown itself changed (aborted requests, the disk tier's flush).
                final = self.engine.engine.take_kv_events()
                if final is not None:
                    self.publisher.publish(final)  # type: ignore[attr-defined]
            self.publisher.close()  # type: ignore[attr-defined]
            self.publisher = None


def _log_startup(state: ServerState) -> None:
    """What an operator needs to know the server serves the right thing, in three lines."""
    engine = state.engine.engine
    runner, cache = engine.runner, engine.config.cache
    serving = state.serving
    logger.info(
        "serving model %s (as %s): dtype %s on %s, max_model_len %d, max_num_seqs %d, max_logprobs %d; layers: %s; %s",
        engine.args.model or _default_model_name(state.engine) + " (embedded)",
        ", ".join(serving.served_model_names),
        str(runner.dtype).removeprefix("torch."),
        runner.device,
        serving.max_model_len,
        serving.max_num_seqs,
        serving.max_logprobs,
        describe_layers(runner.layer_attention),
        runner.kv_layout_note,
    )
    pool_bytes = runner.num_blocks * runner.bytes_per_block
    host = (
        f"{runner.num_host_blocks} blocks ({_mib(runner.num_host_blocks * runner.bytes_per_block)})"
        if runner.num_host_blocks
        else "none"
    )
    disk = "none" if cache.kv_cache_dir is None else f"{cache.kv_cache_dir} (max {cache.kv_cache_dir_max_bytes} bytes)"
    logger.info(
        "KV cache: dtype %s, block size %d, %d blocks x %d B = %s (%d tokens); prefix caching %s; "
        "host tier: %s; disk tier: %s",
        runner.geometry.dtype,
        runner.block_size,
        runner.num_blocks,
        runner.bytes_per_block,
        _mib(pool_bytes),
        runner.num_blocks * runner.block_size,
        "on" if cache.enable_prefix_caching else "off",
        host,
        disk,
    )
    limits = state.args.limits
    logger.info(
        "limits: body %d bytes, %d prompt characters, %d prompts per request, header timeout %g s, "
        "body timeout %g s, %d connections, max_queued_requests %s, request chat templates %s, API key %s",
        limits.max_request_body_bytes,
        serving.max_prompt_chars,
        limits.max_prompts_per_request,
        limits.header_timeout,
        limits.body_timeout,
        limits.max_connections,
        state.args.max_queued_requests,
        "trusted" if limits.trust_request_chat_template else "refused",
        "required" if state.args.api_key else "not required",
    )
    if runner.device.type == "cpu":
        logger.info("%s", describe_cpu_kernels())


def _mib(num_bytes: int) -> str:
    return f"{num_bytes / 2**20:.1f} MiB"


def _default_model_name(engine: AsyncLLM) -> str:
    from pagedkv.worker.model_files import DEFAULT_MODEL_NAME

    model = engine.engine.args.model
    return DEFAULT_MODEL_NAME if model is None else model


def create_app(
    engine_args: EngineArgs | None = None,
    server_args: ServerArgs | None = None,
    *,
    engine: AsyncLLM | None = None,
) -> FastAPI:
    """The server's FastAPI app, on ``engine`` (owned by the caller) or on a new engine built
    from ``engine_args`` (default: the embedded SmolLM2), owned and shut down by the app."""
    server_args = server_args or ServerArgs()
    if engine is not None and engine_args is not None:
        raise ConfigError("pass engine_args or an engine, not both")
    publisher = None
    if server_args.kv_events_endpoint is not None:
        from pagedkv.server.kv_events import KVEventPublisher

        publisher = KVEventPublisher(
            server_args.kv_events_endpoint,
            server_args.kv_events_replay_endpoint,
            topic=server_args.kv_events_topic,
            buffer_steps=server_args.kv_events_buffer_steps,
        )
    owns_engine = engine is None
    try:
        if engine is None:
            engine_args = engine_args or EngineArgs()
            if publisher is not None and not engine_args.enable_kv_cache_events:
                engine_args = _with_kv_events(engine_args)
            engine = AsyncLLM.from_engine_args(engine_args)
        elif publisher is not None and not engine.engine.config.cache.enable_kv_cache_events:
            raise ConfigError("kv_events_endpoint needs an engine built with enable_kv_cache_events=True")
        if publisher is not None:
            engine.set_kv_event_sink(publisher.publish)
            publisher.report_to(engine.engine.background)  # its thread in /health and the metrics
        state = ServerState(engine, server_args, owns_engine=owns_engine, publisher=publisher)
    except BaseException:
        if publisher is not None:
            publisher.close()
        if owns_engine and engine is not None:
            engine.shutdown()
        raise

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        state.close()

    app = FastAPI(title="pagedkv", version=pagedkv.__version__, lifespan=lifespan)
    app.state.pagedkv = state
    _add_error_handlers(app)
    # Added before the auth middleware, so inside it: a client without the key is refused
    # before its body is read.
    limits = server_args.limits
    app.add_middleware(
        BodySizeLimit,
        max_bytes=limits.max_request_body_bytes,
        idle_timeout=limits.header_timeout,
        total_timeout=limits.body_timeout,
    )
    _add_auth(app, server_args.api_key)
    _add_routes(app, state)
    return app


def _with_kv_events(args: EngineArgs) -> EngineArgs:
    from dataclasses import replace

    return replace(args, enable_kv_cache_events=True)


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        errors = exc.errors()
        first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
        if first.get("type") == "json_invalid":
            # Its loc holds a character offset, not a field: say where in the message instead.
            offset = next((p for p in first.get("loc", ()) if isinstance(p, int)), None)
            at = "" if offset is None else f" at character {offset}"
            ctx = first.get("ctx")
            detail = f": {ctx['error']}" if isinstance(ctx, dict) and ctx.get("error") else ""
            return error_response(400, f"the body is not valid JSON{at}{detail}")
        param = _param_of(first.get("loc", ()))
        where = f"{param}: " if param else ""
        return error_response(400, f"{where}{first.get('msg', 'invalid value')}", param=param)

    @app.exception_handler(APIError)
    async def api_error(_: Request, exc: APIError) -> JSONResponse:
        return error_response(exc.status, exc.message, param=exc.param, code=exc.code)

    @app.exception_handler(PagedKVError)
    async def engine_error(_: Request, exc: PagedKVError) -> JSONResponse:
        err = from_exception(exc)
        return error_response(err.status, err.message, param=err.param, code=err.code)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        return error_response(exc.status_code, str(exc.detail))

    @app.exception_handler(Exception)
    async def unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unexpected error while serving a request")
        err = from_exception(exc)
        return error_response(err.status, err.message)


def _param_of(loc: Sequence[int | str]) -> str | None:
    """The request field a validation error's ``loc`` points at (``"stream_options.include_usage"``,
    ``"messages.0.role"``): the path up to the first union member pydantic names (``"str"``,
    ``"list[int]"``, ...), which is a type tried, not a field. A prompt of garbage is
    ``"prompt"``, not ``"prompt.list[int].3"``."""
    parts: list[str] = []
    for p in loc:
        if p == "body" and not parts:
            continue
        if isinstance(p, str) and (p in _TYPE_TAGS or "[" in p or p.startswith("function-")):
            break
        parts.append(str(p))
    return ".".join(parts) or None


# The union members pydantic names in an error's loc without brackets.
_TYPE_TAGS = frozenset({"str", "int", "float", "bool", "dict", "list", "none"})


def _add_auth(app: FastAPI, api_key: str | None) -> None:
    if api_key is None:
        return
    expected = f"Bearer {api_key}".encode()

    @app.middleware("http")
    async def check_api_key(request: Request, call_next: Callable[[Request], Awaitable[Response]]) -> Response:
        if request.method == "OPTIONS" or request.url.path in _OPEN_PATHS:
            return await call_next(request)
        given = request.headers.get("authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            return error_response(401, "missing or wrong API key (Authorization: Bearer <key>)", code="invalid_api_key")
        return await call_next(request)


def _add_routes(app: FastAPI, state: ServerState) -> None:
    serving = state.serving

    @app.get("/health")
    async def health() -> Response:
        if not state.engine.is_running:
            return error_response(503, "the engine is not running")
        report = state.engine.health()
        # 503 while a thread that requests need is dead: a load balancer stops sending work
        # that would hang (the body names the thread and what it died of).
        return JSONResponse(report, status_code=200 if report["status"] == "ok" else 503)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": pagedkv.__version__}

    @app.api_route("/ping", methods=["GET", "POST"])
    async def ping() -> Response:
        """vLLM's (SageMaker's) liveness probe: /health's answer."""
        return await health()

    @app.get("/tokenizer_info")
    async def get_tokenizer_info() -> dict[str, Any]:
        return tokenizer_info(serving.tokenizer, max_model_len=serving.max_model_len)

    @app.get("/dashboard")
    async def dashboard() -> Response:
        """The live KV-cache page (pagedkv.server.dashboard); it polls /dashboard/state."""
        return Response(dashboard_html(), media_type="text/html")

    @app.get("/dashboard/state")
    async def dashboard_state() -> dict[str, Any]:
        snapshot = await state.engine.kv_snapshot()
        return encode_state(snapshot, show_prompts=state.args.dashboard_show_prompts)

    @app.get("/v1/models")
    async def models() -> ModelList:
        root = state.engine.engine.args.model
        return ModelList(
            data=[
                ModelCard(id=name, root=root, max_model_len=serving.max_model_len)
                for name in serving.served_model_names
            ]
        )

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, raw: Request) -> Response:
        return await create_completion(serving, body, raw)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, raw: Request) -> Response:
        return await create_chat_completion(serving, body, raw)

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.engine.is_running:
            state.metrics.update_engine_stats(await state.engine.get_stats())
        payload, content_type = state.metrics.render()
        return Response(payload, media_type=content_type)

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest, raw: Request) -> Response:
        if body.model is not None and body.model not in serving.served_model_names:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        if (body.prompt is None) == (body.messages is None):
            raise APIError(400, "give either prompt or messages", param="prompt")
        if body.messages is not None:
            rendered = await render_chat(
                serving,
                body.messages,
                raw,
                chat_template=body.chat_template,
                add_generation_prompt=body.add_generation_prompt,
            )
            if rendered is None:  # the client left
                return Response(status_code=499)
            ids = rendered["prompt_token_ids"]
        else:
            assert body.prompt is not None
            serving.check_prompt_chars(len(body.prompt))
            ids = await serving.tokenize(body.prompt, add_special_tokens=body.add_special_tokens)
        return JSONResponse({"count": len(ids), "max_model_len": serving.max_model_len, "tokens": ids})

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, str]:
        if body.model is not None and body.model not in serving.served_model_names:
            raise APIError(404, f"The model `{body.model}` does not exist.", param="model", code="model_not_found")
        return {"prompt": await serving.detokenize(body.tokens)}

    @app.get("/kv_cache_info")
    async def kv_cache_info() -> dict[str, object]:
        """What a KV-aware router needs to follow this engine: the block size its hashes are
        computed over, and where its KV events are published (see ``pagedkv router``)."""
        engine = state.engine.engine
        return {
            "block_size": engine.runner.block_size,
            "num_blocks": engine.runner.num_blocks,
            "num_host_blocks": engine.runner.num_host_blocks,
            "kv_cache_dtype": engine.runner.geometry.dtype,
            "enable_prefix_caching": engine.config.cache.enable_prefix_caching,
            "kv_events_endpoint": state.args.kv_events_endpoint,
            "kv_events_replay_endpoint": state.args.kv_events_replay_endpoint,
            "kv_events_topic": state.args.kv_events_topic,
            # Disaggregated prefill / decode: this engine's role, id and control address.
            "kv_transfer": None
            if engine.kv_connector is None
            else {
                "role": engine.kv_connector.config.role,
                "engine_id": engine.kv_connector.engine_id,
                "transport": engine.kv_connector.transport.kind,
                "control_address": engine.kv_connector.address,
            },
        }

    @app.post("/reset_prefix_cache")
    async def reset_prefix_cache() -> dict[str, int]:
        """Drop every cached block that no request uses, on every tier."""
        return {"num_blocks_dropped": await state.engine.reset_prefix_cache()}

    if os.environ.get(DEV_MODE_ENV) == "1":
        # Development and test endpoints (vLLM's VLLM_SERVER_DEV_MODE): behind the API key.

        @app.post("/dev/check_invariants")
        async def check_invariants() -> dict[str, int]:
            """The KV cache's bookkeeping checked between steps, and who holds blocks
            (``LLMEngine.check_invariants``; a violation is a 500)."""
            return await state.engine.check_invariants()
