"""``POST /v1/chat/completions``."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse
from starlette.requests import Request

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.structured.params import StructuredOutputsParams
from kvwarden.server.access_log import AccessRecord, access_record
from kvwarden.server.async_engine import AsyncEngine
from kvwarden.server.chat_tools import (
    ChoiceStream,
    ToolPlan,
    ToolSettings,
    after_reasoning,
    message,
    plan,
    template_messages,
)
from kvwarden.server.formatting import (
    TokenText,
    chat_logprobs,
    choice_params,
    compile_constraint,
    sampling_params,
    usage,
    with_spec,
)
from kvwarden.server.protocol import ApiError, ChatCompletionRequest, require_text
from kvwarden.server.sse import EventStream, until_disconnected
from kvwarden.server.streams import Job, choice_deltas, collect, invalid_prompt


class ChatCompletions:
    def __init__(self, engine: AsyncEngine, model_name: str, tools: ToolSettings | None = None) -> None:
        self.engine = engine
        self.model_name = model_name
        self.tools = tools or ToolSettings()

    def _prompt(self, req: ChatCompletionRequest) -> list[int]:
        engine = self.engine.engine
        require_text(req.messages, "messages")
        tokenizer = engine.tokenizer
        source = tokenizer.chat_template or ""
        if req.tools and "tools" not in source:  # it would render nothing of them: refused, not ignored
            raise ApiError(400, "tools: this model's chat template does not render tools", "tools", "invalid_value")
        for key in req.chat_template_kwargs or {}:
            if key not in source:
                raise ApiError(
                    400, f"chat_template_kwargs.{key}: this model's chat template does not read it",
                    f"chat_template_kwargs.{key}", "invalid_value",
                )  # fmt: skip
        tools = [t.model_dump(exclude_none=True) for t in req.tools] if req.tools else None
        try:
            text = tokenizer.apply_chat_template(
                template_messages(req), req.add_generation_prompt, tools, req.chat_template_kwargs
            )
            return engine.tokenize(text)
        except ValueError as exc:
            raise invalid_prompt(exc, "messages") from exc

    def _jobs(
        self, req: ChatCompletionRequest, ids: list[int], structured: StructuredOutputsParams | None
    ) -> list[Job]:
        if req.top_logprobs is not None and not req.logprobs:
            raise ApiError(400, "top_logprobs requires logprobs: true", "top_logprobs", "invalid_value")
        if req.max_tokens is not None and req.max_completion_tokens not in (None, req.max_tokens):
            raise ApiError(
                400,
                f"max_tokens ({req.max_tokens}) and max_completion_tokens ({req.max_completion_tokens}) disagree: "
                "send one (max_tokens is the older name of max_completion_tokens)",
                "max_completion_tokens",
                "invalid_value",
            )
        max_tokens = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        params = sampling_params(
            req,
            max_tokens=max_tokens,
            prompt_len=len(ids),
            max_model_len=self.engine.engine.max_model_len,
            kv_capacity=self.engine.kv_capacity,
            logprobs=(req.top_logprobs or 0) if req.logprobs else None,
            prompt_param="messages",
            structured=structured,
        )
        return [Job(j, ids, choice_params(params, j), req.cache_salt, req.prefill_url) for j in range(req.n)]

    async def create(self, req: ChatCompletionRequest, request: Request) -> JSONResponse | EventStream:
        ids = self._prompt(req)
        tools, reasoning = plan(req, self.tools), self.tools.reasoning_parser
        structured = await compile_constraint(
            req, self.engine.engine.grammars, lambda own: after_reasoning(tools.constraint or own, reasoning)
        )
        jobs = self._jobs(req, ids, structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        record = access_record(request)
        record.request_id = rid
        record.prompt_tokens = len(ids)  # known now: an aborted request's line says it too
        token_text = TokenText(self.engine.engine.tokenizer, req.return_tokens_as_token_ids)
        if req.stream:
            chunks = self._stream(req, jobs, rid, token_text, len(ids), record, tools)
            return EventStream(chunks)
        final = await until_disconnected(request, collect(self.engine, jobs, rid))
        choices = []
        for job in jobs:
            out = final[job.index]
            logprobs = None
            if req.logprobs and out.logprobs is not None:
                logprobs = chat_logprobs(out.token_ids, out.sampled_logprobs, out.logprobs, token_text)
            body, called = message(out.text, tools, reasoning)
            choice = {
                "index": job.index,
                "message": body,
                "logprobs": logprobs,
                "finish_reason": "tool_calls" if called and out.finish_reason == "stop" else out.finish_reason,
                "stop_reason": out.stop_reason,
            }
            choices.append(with_spec(choice, out))
        body = {
            "id": rid,
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(*_usage_counts(len(ids), final, record), final.values()),
        }
        return JSONResponse(body)

    async def _stream(
        self,
        req: ChatCompletionRequest,
        jobs: list[Job],
        rid: str,
        token_text: TokenText,
        prompt_len: int,
        record: AccessRecord,
        tools: ToolPlan,
    ) -> AsyncGenerator[dict[str, Any], None]:
        created = int(time.time())

        def chunk(choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
            return {
                "id": rid,
                "object": "chat.completion.chunk",
                "created": created,
                "model": self.model_name,
                "choices": choices,
                **extra,
            }

        for job in jobs:
            yield chunk(
                [
                    {
                        "index": job.index,
                        "delta": {"role": "assistant", "content": ""},
                        "logprobs": None,
                        "finish_reason": None,
                    }
                ]
            )
        finals: dict[int, RequestOutput] = {}
        streams = {job.index: ChoiceStream(tools, self.tools.reasoning_parser) for job in jobs}
        events = choice_deltas(self.engine, jobs, rid)
        async with contextlib.aclosing(events):
            async for index, text, new, out in events:
                record.count_output(index, len(out.token_ids))
                logprobs = None
                if req.logprobs and out.logprobs is not None:
                    logprobs = chat_logprobs(
                        [out.token_ids[i] for i in new],
                        [out.sampled_logprobs[i] for i in new],
                        [out.logprobs[i] for i in new],
                        token_text,
                    )
                stream = streams[index]
                deltas = stream.feed(text) if text else []
                if out.finished:
                    deltas += stream.finish()
                if not deltas and logprobs is None and not out.finished:
                    continue  # nothing to send yet (inside a UTF-8 character, a marker, or a constrained call)
                for n, delta in enumerate(deltas or [{}]):
                    last = n == max(len(deltas), 1) - 1
                    choice: dict[str, Any] = {
                        "index": index,
                        "delta": delta,
                        "logprobs": logprobs if n == 0 else None,
                        "finish_reason": None,
                    }
                    if last and out.finished:
                        reason = out.finish_reason
                        choice["finish_reason"] = "tool_calls" if stream.called and reason == "stop" else reason
                        choice["stop_reason"] = out.stop_reason
                        finals[index] = out
                    yield chunk([with_spec(choice, out)])
        counts = _usage_counts(prompt_len, finals, record)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield chunk([], usage=usage(*counts, finals.values()))


def _usage_counts(prompt_len: int, finals: dict[int, RequestOutput], record: AccessRecord) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens, also noted for the access log."""
    counts = (prompt_len, sum(len(o.token_ids) for o in finals.values()), finals[0].num_cached_tokens)
    record.set_usage(*counts)
    return counts
