"""The Serve application: a FastAPI ingress deployment, the global scheduler.

    serve run manifests/local.yaml      # import_path: cluster.app:build_app

Endpoints: POST /generate (SGLang-style), POST /v1/completions, POST
/v1/chat/completions (streaming SSE ending in [DONE]), POST /v1/responses (what it
stores, and /v1/conversations: cluster/stored_endpoints.py), POST /tokenize and
/detokenize (vLLM's), the endpoints acting on every worker (/flush_cache,
/abort_request, /start_profile, /stop_profile: cluster/worker_endpoints.py), GET
/v1/models, GET /health
(200 only when both pools are ready), GET /metrics (Prometheus text), and the
OpenAPI schema at /openapi.json. Errors are JSON: {"error": {"message", "type", "param",
"code"}}; 400 for bad input, 401 for a missing or wrong API key, 413 for an
oversized body, 429 with Retry-After for an early SLO rejection, 503 while not ready
(cluster/ingress_guard.py).
"""


import asyncio
import contextlib
import functools
import logging
import time
import uuid

from fastapi import FastAPI
from fastapi.responses import JSONResponse, PlainTextResponse
import ray
from ray import serve

from actors.background import background_task, run_to_end
from actors.block_pool import kv_namespace
from actors.config import ModelConfig
from actors.regex_dfa import request_work
from actors.sampling_defaults import SamplingDefaults
from actors.sampling_params import SamplingParams
from actors.startup_heap import freeze_startup_heap
from actors.tokenization import encode_prompt, load_tokenizer
from cluster import openai_format as fmt
from cluster import responses_format
from cluster import sglang_format as sglang
from cluster import stored_endpoints, worker_endpoints
from cluster.actor_errors import actor_unavailable
from cluster.admission import SloRejected
from cluster.api_models import (ApiError, ChatBody, CompletionBody, DetokenizeBody, TokenizeBody, choice_params,
                                knows_developer_role, template_messages)
from cluster.background_responses import BackgroundResponses, EventFeed, stream_to_store
from cluster.completions import Completions
from cluster.config import AppSettings
from cluster.conversation_truncation import drop_oldest_turns
from cluster.early_pools import start_pools_early
from cluster.ingress_guard import install_guard, refusal
from cluster.pool_manager import get_or_create_pool
from cluster.pool_settings import check_redeploy
from cluster.pool_view import PoolView
from cluster.prompt_limits import output_room, prompt_room
from cluster.prompt_thread import PromptThread, prompt_work_is_large
from cluster.reasoning import Reasoning
from cluster.responses_body import ResponsesBody
from cluster.responses_format import ResponseEvents
from cluster.service import GlobalScheduler
from cluster.sglang_body import GenerateBody
from cluster.stored_conversations import ConversationTurn, StoredConversations
from cluster.stored_responses import StoredResponses
from cluster.strict_json import StrictJsonRoute
from cluster.tool_calls import TOOL_CALL_FORMATS

log = logging.getLogger("tandem.app")
SHUTDOWN_MARGIN_S = 10.0  # a stopping replica's grace past the request timeout (build_app)
HEALTH_GENERATE_S = 20.0  # /health_generate's token must come within this (SGLang's default)
app = FastAPI(title="Tandem", description="Prefill/decode disaggregated LLM serving on Ray", version="0.1.0")
app.router.route_class = StrictJsonRoute  # a lone surrogate in a body is a 400 (cluster/strict_json.py)
install_guard(app)  # the API key, the body size limit, errors as JSON (cluster/ingress_guard.py)
app.include_router(stored_endpoints.router)  # stored responses and conversations (cluster/stored_endpoints.py)
app.include_router(worker_endpoints.router)  # cache flush, aborts, traces (cluster/worker_endpoints.py)


def _failure(exc: Exception) -> dict:
    """A background response's error: its request's refusal (an SLO rejection,
    say), or a server error that names only the exception's type, as an
    endpoint's 500 does (the traceback goes to the log)."""
    refused = refusal(exc)
    if refused is None:
        log.exception("background response failed")
        return {"code": "server_error", "message": f"internal error: {type(exc).__name__}"}
    return {"code": refused.kind, "message": str(refused)}


async def _sampling(prompt_thread: PromptThread, body, *args):
    """A body's params. A pattern's automaton (structured output) is compiled on
    the way, up to about a second for the largest (once a pattern: cached), and
    about two for all a request asks for (`request_work`): in a thread then, so
    the event loop goes on serving the other requests; a large body's checks (a
    logit_bias of 150k entries: 0.1 s a copy) on the prompt thread, as its
    prompt's work is (cluster/prompt_thread.py)."""
    def sampling():
        with request_work():
            return body.sampling(*args)

    if body.asks_structure:
        return await asyncio.to_thread(sampling)
    return await prompt_thread.run(sampling)


@serve.deployment(ray_actor_options={"num_cpus": 0}, max_ongoing_requests=512)
@serve.ingress(app)
class Scheduler:
    def __init__(self, settings: dict) -> None:
        self.settings = AppSettings.model_validate(settings)
        model_dir = self.model_dir = self.settings.model.location().resolve()
        self.tokenizer = load_tokenizer(model_dir)
        # A token id's text alone (SGLang's return_text_in_logprobs), cached: a streamed
        # /generate rebuilds its logprob entries at every event.
        self.token_text = functools.lru_cache(maxsize=1 << 16)(lambda token_id: self.tokenizer.decode([token_id]))
        self.sampling_defaults = SamplingDefaults.load(model_dir, self.settings.sampling_defaults)
        self.tool_format = TOOL_CALL_FORMATS[self.settings.tool_call_parser]  # how the model writes calls
        self.developer_as_system = not knows_developer_role(self.tokenizer.chat_template)  # (its template's roles)
        self.prompt_thread = PromptThread()  # templates and tokenizing, off the event loop (cluster/prompt_thread.py)
        model_config = ModelConfig.from_hf(model_dir)
        model_len = model_config.max_position_embeddings
        max_model_len = min(self.settings.engine.max_model_len or model_len, model_len)
        self.pool = get_or_create_pool(self.settings)
        kv_seed = kv_namespace(model_dir, self.settings.engine.dtype, self.settings.engine.block_size)
        self.service = GlobalScheduler(self.settings, self.tokenizer, self.pool, max_model_len, kv_seed,
                                       model_config.eos_token_ids, model_config.vocab_size)
        self.model_name = self.settings.model.served_name
        self.created = int(time.time())  # /v1/models' `created`: when this replica started serving the model
        self.completions = Completions(self.service, self.tokenizer, self.model_name, self.tool_format)
        self.stored = StoredResponses(lambda: self.pool, self.settings.response_store_mib)
        self.conversations = StoredConversations(self.stored, self.settings.limits.request_timeout_s)
        self.background = BackgroundResponses(self.stored)
        app.state.settings = self.settings
        app.state.stored, app.state.conversations = self.stored, self.conversations  # (cluster/stored_endpoints.py)
        app.state.background = self.background
        app.state.refreshed_view = self._refreshed_view  # (cluster/worker_endpoints.py)
        self._refresher: asyncio.Task | None = None
        self._refreshing: asyncio.Task | None = None  # the refresh under way (`_refresh`)
        freeze_startup_heap()  # full collections skip the start-up heap (actors/startup_heap.py)
        # Membership and start-up profiles from now on, not from the first request:
        # /health turns ready by itself, and no first client waits for a refresh.
        with contextlib.suppress(RuntimeError):  # no running loop (outside Serve): the first request starts it
            self._ensure_refreshing()

    # ---- background membership refresh ----------------------------------------------
    def _ensure_refreshing(self) -> None:
        if self._refresher is None or self._refresher.done():  # maybe in a request: not part of it
            self._refresher = background_task(self._refresh_loop())

    async def _refresh_loop(self) -> None:
        while True:
            await self._refresh()
            await asyncio.sleep(1.0)

    def _refresh(self) -> asyncio.Task:
        """The refresh under way, else a new one: one at a time. Two at once (the
        loop's and a request's while the view is not ready) could forget a worker
        while the other read its cache events (a KeyError: the view not ready, 503s
        until the next), or apply a worker's events out of order. Not part of any
        request: a client that leaves must not cancel the calls every caller waits on."""
        if self._refreshing is None or self._refreshing.done():
            self._refreshing = background_task(self._refresh_once())
        return self._refreshing

    async def _refresh_once(self) -> None:
        """Membership and load from the pool manager. A pool manager that is gone
        for good (its workers went with it) is replaced: the new one starts fresh
        pools and /health says "starting" until they are ready. One unreachable
        for now is not (its actor was found again by name, and everything the
        view had learned of the workers thrown away, with 503s until the next
        refresh): the view serves on as it was."""
        try:
            await self.service.view.refresh()
        except ray.exceptions.RayActorError as exc:
            if actor_unavailable(exc):
                log.warning("pool manager %s is unreachable for now (%s)", self.settings.pool_name, exc)
                return
            log.warning("pool manager %s is gone (%s); starting a new one", self.settings.pool_name, exc)
            self.pool = get_or_create_pool(self.settings)
            self.service.view.replace_pool(self.pool)
        except Exception as exc:  # keep refreshing; /health reports not ready
            log.warning("refresh failed: %s", exc)
            self.service.view.ready = False

    async def _refreshed_view(self) -> PoolView:
        """The replica's view of the pools, refreshed now if it is not ready (503
        where the manifest's pool settings were refused). The worker endpoints
        act on the workers it has, ready or not: a pool being replaced kept
        /abort_request, /flush_cache and /stop_profile from the workers that
        were up."""
        self._ensure_refreshing()
        if not self.service.view.ready:  # a client that leaves meanwhile must not cancel the refresh's calls
            await asyncio.shield(self._refresh())
        view = self.service.view
        if view.settings_refusal:
            raise ApiError(503, view.settings_refusal, kind="service_unavailable")
        return view

    async def _require_ready(self) -> None:
        view = await self._refreshed_view()
        if not view.ready:
            raise ApiError(503, "worker pools are starting; retry shortly", kind="service_unavailable",
                           headers={"Retry-After": "5"})

    # ---- endpoints --------------------------------------------------------------------
    @app.api_route("/health", methods=["GET", "HEAD"])  # (load balancers probe with HEAD too)
    async def health(self):
        self._ensure_refreshing()
        status, body = self.service.view.health()
        return JSONResponse(body, status_code=status)

    @app.get("/health_generate")
    async def health_generate(self):
        """SGLang's deep health check: one greedy token generated through the whole
        path (tokenizer, routing, prefill, the KV transfer, decode) within
        HEALTH_GENERATE_S: 200 with the seconds it took; 503 saying what failed.
        A probe that SLO admission turns away answers 200 `busy`: the pools work
        and are full, and a liveness probe must not restart a server for its load."""
        await self._require_ready()
        params = SamplingParams(max_new_tokens=1, temperature=0, ignore_eos=True)
        prompt_ids = encode_prompt(self.tokenizer, "ping")
        started = time.monotonic()

        async def one_token():
            streams = await self.completions.start_choices([(prompt_ids, params, f"health-{uuid.uuid4().hex}")], 1)
            await self.completions.collect_all(streams)

        try:
            await asyncio.wait_for(one_token(), HEALTH_GENERATE_S)
        except SloRejected as exc:
            return {"status": "busy", "message": str(exc)}
        except asyncio.TimeoutError:
            raise ApiError(503, f"no token generated within {HEALTH_GENERATE_S:g} s", kind="service_unavailable",
                           headers={"Retry-After": "5"}) from None
        return {"status": "ok", "seconds": round(time.monotonic() - started, 3)}

    @app.get("/metrics")
    async def metrics(self):
        return PlainTextResponse(self.service.metrics.render(), media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models(self):
        return {"object": "list", "data": [self._model_card()]}

    @app.get("/v1/models/{model:path}")
    async def model(self, model: str):
        """OpenAI's retrieve (`client.models.retrieve`); 404 for a model not served here."""
        self._check_model(model)
        return self._model_card()

    @app.get("/version")
    async def version(self):
        """vLLM's: the server's version."""
        return {"version": app.version}

    @app.get("/get_model_info")
    async def model_info(self):
        """SGLang's: the checkpoint this deployment serves (SGLang's clients, such as
        its frontend language's `RuntimeEndpoint`, read it on connecting)."""
        return {"model_path": str(self.model_dir), "tokenizer_path": str(self.model_dir), "is_generation": True,
                "served_model_name": self.model_name}

    def _model_card(self) -> dict:  # max_model_len: vLLM's field, which clients size prompts by
        return {"id": self.model_name, "object": "model", "created": self.created, "owned_by": "tandem",
                "max_model_len": self.service.max_model_len}

    @app.post("/generate")
    async def generate(self, body: GenerateBody):
        """One prompt, or SGLang's batch; request k is prompt k // n's choice k % n
        (see cluster/completions.py `start_choices`). meta_info's id is the prompt's rid (the client's,
        or one made up), with `-j` for choice j when n > 1."""
        per_prompt = await _sampling(self.prompt_thread, body, self.settings.limits.max_new_tokens,
                                     self.sampling_defaults)
        await self._require_ready()
        prompt_ids = await self.prompt_thread.run(
            lambda: [self.service.prepare(p, params) for p, params in zip(body.prompts(), per_prompt)])
        shortest = min(len(ids) for ids in prompt_ids)
        if body.return_logprob and body.logprob_start_len >= shortest:  # (SGLang refuses it; it was answered [])
            raise ApiError(400, f"logprob_start_len ({body.logprob_start_len}) must be less than the prompt's "
                                f"{shortest} tokens", param="logprob_start_len")
        n = body.num_choices
        rids = [rid or uuid.uuid4().hex for rid in body.rids()]
        choices = [choice_params(params, n) for params in per_prompt]
        keys = range(len(prompt_ids) * n)
        ids = [rids[k // n] if n == 1 else f"{rids[k // n]}-{k % n}" for k in keys]
        requests = [(prompt_ids[k // n], choices[k // n][k % n], ids[k], rids[k // n]) for k in keys]
        streams = await self.completions.start_choices(requests, n)
        token_text = self.token_text if body.return_text_in_logprobs else None
        prompts_only = body.prompts_only()
        answered = [sglang.Answered(ids[k], prompt_ids[k // n], body.logprob_start_len, body.top_logprobs_num,
                                    token_text, prompts_only[k // n]) for k in keys]
        if body.stream:
            return fmt.sse_response(sglang.stream(streams, answered, indexed=body.answers_a_list))
        results = await self.completions.collect_all(streams)
        answers = [sglang.result(out, a) for out, a in zip(results, answered)]
        return answers if body.answers_a_list else answers[0]

    @app.post("/v1/completions")
    async def completions(self, body: CompletionBody):
        return await self._openai(body, body.prompts(), chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, body: ChatBody):
        prompt = await self.prompt_thread.run(self._chat_prompt, body)
        reasoning = Reasoning.of(prompt) if self.settings.reasoning_parser else None
        return await self._openai(body, [prompt], chat=True, reasoning=reasoning)

    @app.post("/v1/responses")
    async def responses(self, body: ResponsesBody):
        """OpenAI's Responses API: the chat request it asks for, going on from the
        stored response it continues or the conversation it is on
        (cluster/responses_body.py; its oldest turns dropped to fit, with
        `truncation: "auto"`), its answer as a response or its events
        (cluster/responses_format.py), kept unless `store` is false
        (cluster/stored_responses.py) and added to its conversation
        (cluster/stored_conversations.py); or answered at once, with `background`."""
        if body.stores and not self.stored.enabled:
            if body.background:
                raise ApiError(400, "background: a background response is stored, and this server stores none "
                                    "(response_store_mib is 0)")
            body = body.model_copy(update={"store": False})  # (answered as not stored)
        response_id = responses_format.new_id("resp")
        turn = await self.conversations.turn(body.conversation_id, response_id) if body.conversation_id else None
        try:
            return await self._respond(body, response_id, turn)
        except BaseException:  # (refused, failed, or its client left before an answer)
            if turn is not None:
                turn.abandon()
            raise

    async def _respond(self, body: ResponsesBody, response_id: str, turn: ConversationTurn | None):
        if turn is not None:
            history, name = turn.items, "conversation"
        else:
            history = await self.stored.conversation(body.previous_response_id) if body.previous_response_id else []
            name = "previous_response_id"
        if history:  # (its prompt's work is the stored history's, whatever the body's size: on the prompt thread)
            prompt_work_is_large()
        chat = await self.prompt_thread.run(body.chat_body, history, name)
        if body.truncation == "auto":
            chat = await self.prompt_thread.run(self._fitted, chat)
        prompt = await self.prompt_thread.run(self._chat_prompt, chat)
        reasoning = Reasoning.of(prompt) if self.settings.reasoning_parser else None
        items = body.input_items() if body.stores or turn is not None else []
        if body.background:
            return await self._background(body, response_id, chat, prompt, reasoning, items, turn)

        async def keep(response: dict) -> dict:  # (stored, and its turn ended, by one store call)
            if turn is not None:
                turn.handed_on()
            # (run to its end: in the request's task, the call went with a client that left
            # meanwhile, and the turn, handed on, stayed held for its lease)
            return await run_to_end(self.stored.keep(response, items))

        if not body.stream:
            completion = await self._openai(chat, [prompt], chat=True, reasoning=reasoning, rid=response_id)
            return await keep(responses_format.whole(body, completion, response_id))
        events = ResponseEvents(body, self.model_name, keep, response_id)
        stream = events.stream if turn is None else lambda chunks: turn.over_with(events.stream(chunks))
        return await self._openai(chat, [prompt], chat=True, reasoning=reasoning, rid=response_id,
                                  stream_as=lambda chunks: fmt.sse_response(stream(chunks)))

    async def _background(self, body: ResponsesBody, response_id: str, chat: ChatBody, prompt: str, reasoning,
                          items: list[dict], turn: ConversationTurn | None) -> dict:
        """A background response (cluster/background_responses.py): checked (bad
        input is still a 4xx), stored queued, and answered so; admitted and
        served by this replica in a task of its own (a refusal then, such as an
        SLO rejection, is the response's failure). Its turn on a conversation is
        the store's to end, as the response ends."""
        prepared = await self._prepared(chat, [prompt], True, reasoning)
        queued = responses_format.response(body, response_id, self.model_name, int(time.time()), "queued", [])
        if not await self.stored.queue(queued, items, streamed=body.stream):
            raise ApiError(400, "background: the request is too large to store")
        if turn is not None:
            turn.handed_on()
        if body.stream:
            feed = EventFeed()
            self.background.start(response_id, self._background_events(body, chat, prompt, reasoning, prepared,
                                                                       queued, items, feed), on_end=feed.close)
            return fmt.sse_response(feed.read())

        async def answer():
            try:
                completion = await self._openai(chat, [prompt], chat=True, reasoning=reasoning, prepared=prepared,
                                                rid=queued["id"])
                final = responses_format.whole(body, completion, queued["id"], queued["created_at"])
            except Exception as exc:
                final = {**queued, "status": "failed", "error": _failure(exc)}
            await self.stored.finish(final, items)

        self.background.start(queued["id"], answer())
        return queued

    async def _background_events(self, body: ResponsesBody, chat: ChatBody, prompt: str, reasoning, prepared,
                                 queued: dict, items: list[dict], feed: EventFeed) -> None:
        """A streamed background response, served: its events to `feed` and the
        store (cluster/background_responses.py `stream_to_store`), the final
        response stored with the last of them."""
        final: dict = {}

        async def hold(response: dict) -> dict:  # (stored with the last events, once they are written)
            final.update(response)
            return response

        events = ResponseEvents(body, self.model_name, hold, queued["id"], queued["created_at"])

        async def served():  # queued at once; admitted (or refused), the answer's events
            for event in events.queued_events():
                yield event
            try:
                stream = await self._openai(chat, [prompt], chat=True, reasoning=reasoning, prepared=prepared,
                                            stream_as=events.stream, rid=queued["id"])
            except Exception as exc:
                stream = events.refused(_failure(exc))
            async with contextlib.aclosing(stream):
                async for event in stream:
                    yield event

        await stream_to_store(self.stored, queued["id"], served(), feed,
                              lambda last, first: self.stored.finish(final, items, last, first))

    @app.post("/tokenize")
    async def tokenize(self, body: TokenizeBody):
        """The token ids a completion (`prompt`) or chat (`messages`) request would
        give the model, as vLLM's /tokenize answers (count them before sending)."""
        self._check_model(body.model)

        def tokenized() -> list[int]:
            prompt = self._chat_prompt(body) if body.messages is not None else body.prompt
            return encode_prompt(self.tokenizer, prompt, add_special_tokens=body.add_special_tokens)

        ids = await self.prompt_thread.run(tokenized)
        strs = {"token_strs": self.tokenizer.convert_ids_to_tokens(ids)} if body.return_token_strs else {}
        return {"tokens": ids, "count": len(ids), "max_model_len": self.service.max_model_len, **strs}

    @app.post("/detokenize")
    async def detokenize(self, body: DetokenizeBody):
        """vLLM's: the text of token ids (up to a million, checked and decoded off
        the event loop for a large body, as /tokenize's text is encoded)."""
        self._check_model(body.model)

        def decoded() -> str:
            vocab = len(self.tokenizer)
            if any(not 0 <= t < vocab for t in body.tokens):
                raise ApiError(400, f"token ids must be in [0, {vocab})")
            return self.tokenizer.decode(body.tokens)

        return {"prompt": await self.prompt_thread.run(decoded)}

    def _chat_prompt(self, body) -> str:
        """The chat template's text for a body's messages (cluster/api_models.py
        `_ChatTemplateFields`: an assistant turn opened, or the last one continued)."""
        messages = template_messages(body.messages, self.developer_as_system)
        if body.continue_final_message and messages[-1]["role"] != "assistant":
            raise ApiError(400, "continue_final_message continues an assistant's message: the last message's role "
                                f"is {messages[-1]['role']!r}")
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, tools=body.template_tools(),
                                                      add_generation_prompt=body.add_generation_prompt,
                                                      continue_final_message=body.continue_final_message,
                                                      **(body.chat_template_kwargs or {}))
        except Exception as exc:  # a template error is the client's messages
            raise ApiError(400, f"cannot apply the chat template: {exc}") from None

    def _fitted(self, chat: ChatBody) -> ChatBody:
        """`chat` with the oldest turns dropped that keep its prompt from fitting
        the limits (cluster/conversation_truncation.py)."""
        asked = next((n for n in (chat.max_completion_tokens, chat.max_tokens) if n is not None), None)
        room = prompt_room(self.settings.limits, self.service.max_model_len, output_room(asked, chat.min_tokens))

        def fits(messages) -> bool:
            prompt = self._chat_prompt(chat.model_copy(update={"messages": messages}))
            return len(encode_prompt(self.tokenizer, prompt, add_special_tokens=chat.add_special_tokens)) <= room

        return chat.model_copy(update={"messages": drop_oldest_turns(chat.messages, fits)})

    # ---- helpers ------------------------------------------------------------------------
    def _check_model(self, model: str | None) -> None:
        """A body that names a model names this server's (or none): 404 otherwise, as
        OpenAI and vLLM answer, on every endpoint that takes `model`."""
        if model is not None and model != self.model_name:
            raise ApiError(404, f"model {model!r} not found; this server serves {self.model_name!r}",
                           kind="model_not_found")

    async def _prepared(self, body, prompts: list, chat: bool, reasoning: Reasoning | None = None) -> tuple:
        """A body's sampling params and prompt ids, checked: 404 for another model,
        400s for bad params or prompts past the limits, 503 while the pools start."""
        self._check_model(body.model)
        if chat:
            params = await _sampling(self.prompt_thread, body, self.settings.limits.max_new_tokens,
                                     self.sampling_defaults, reasoning, self.tool_format)
        else:
            params = await _sampling(self.prompt_thread, body, 16, self.sampling_defaults)
        await self._require_ready()
        return params, await self.prompt_thread.run(
            lambda: [self.service.prepare(prompt, params, add_special_tokens=body.add_special_tokens,
                                          keep_last=body.truncate_prompt_tokens) for prompt in prompts])

    async def _openai(self, body, prompts: list, chat: bool, reasoning: Reasoning | None = None, stream_as=None,
                      prepared: tuple | None = None, rid: str | None = None):
        """A completion or chat body's answer (cluster/completions.py); `prepared`:
        what `_prepared` gave for it, where it ran before; `rid`: what
        `/abort_request` knows it by, where not the completion's id."""
        params, prompt_ids = prepared or await self._prepared(body, prompts, chat, reasoning)
        return await self.completions.answer(body, prompts, params, prompt_ids, chat, reasoning, stream_as, rid)


def build_app(args: dict):
    """Serve's application builder: `import_path: cluster.app:build_app`."""
    settings = AppSettings.model_validate(args)
    check_redeploy(settings)  # pools started from another manifest run: refused, the replicas before serve on
    start_pools_early(settings)  # beside the replicas' start, not after it (cluster/early_pools.py)
    # A replica that Serve stops (a redeploy, fewer replicas, `serve shutdown`) takes
    # no new request and finishes those it has: each ends within the request timeout,
    # where Serve's default grace of 20 s would cut a long stream short. It checks for
    # them every quarter second (Serve's default waits 2 s even when it has none).
    return Scheduler.options(
        num_replicas=settings.scheduler_replicas,
        graceful_shutdown_timeout_s=settings.limits.request_timeout_s + SHUTDOWN_MARGIN_S,
        graceful_shutdown_wait_loop_s=0.25,
    ).bind(settings.model_dump())
