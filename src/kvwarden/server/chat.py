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
from kvwarden.server.streams import Job, choice_deltas, collect


class ChatCompletions:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _prompt(self, req: ChatCompletionRequest) -> list[int]:
        engine = self.engine.engine
        require_text(req.messages, "messages")
        messages = [{"role": m.role, "content": m.text()} for m in req.messages]
        try:
            text = engine.tokenizer.apply_chat_template(messages, add_generation_prompt=req.add_generation_prompt)
            return engine.tokenize(text)
        except ValueError as exc:
            raise ApiError(400, str(exc), "messages", "invalid_value") from exc

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
        structured = await compile_constraint(req, self.engine.engine.grammars)
        jobs = self._jobs(req, ids, structured)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        record = access_record(request)
        record.request_id = rid
        token_text = TokenText(self.engine.engine.tokenizer, req.return_tokens_as_token_ids)
        if req.stream:
            chunks = self._stream(req, jobs, rid, token_text, len(ids), record)
            return EventStream(chunks)
        final = await until_disconnected(request, collect(self.engine, jobs, rid))
        choices = []
        for job in jobs:
            out = final[job.index]
            logprobs = None
            if req.logprobs and out.logprobs is not None:
                logprobs = chat_logprobs(out.token_ids, out.sampled_logprobs, out.logprobs, token_text)
            choice = {
                "index": job.index,
                "message": {"role": "assistant", "content": out.text},
                "logprobs": logprobs,
                "finish_reason": out.finish_reason,
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
        events = choice_deltas(self.engine, jobs, rid)
        async with contextlib.aclosing(events):
            async for index, text, new, out in events:
                logprobs = None
                if req.logprobs and out.logprobs is not None:
                    logprobs = chat_logprobs(
                        [out.token_ids[i] for i in new],
                        [out.sampled_logprobs[i] for i in new],
                        [out.logprobs[i] for i in new],
                        token_text,
                    )
                if not text and logprobs is None and not out.finished:
                    continue  # a token that ends inside a UTF-8 character: nothing to send until it completes
                choice: dict[str, Any] = {
                    "index": index,
                    "delta": {"content": text} if text else {},
                    "logprobs": logprobs,
                    "finish_reason": out.finish_reason,
                }
                if out.finished:
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
