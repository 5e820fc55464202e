"""``POST /v1/completions``."""

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
    choice_params,
    compile_constraint,
    completion_logprobs,
    sampling_params,
    usage,
    with_spec,
)
from kvwarden.server.protocol import ApiError, CompletionRequest, require_text
from kvwarden.server.sse import EventStream, until_disconnected
from kvwarden.server.streams import Job, choice_deltas, collect, invalid_prompt

DEFAULT_MAX_TOKENS = 16  # OpenAI's legacy completions default


class Completions:
    def __init__(self, engine: AsyncEngine, model_name: str) -> None:
        self.engine = engine
        self.model_name = model_name

    def _prompts(self, req: CompletionRequest) -> list[list[int]]:
        raw = req.prompt
        require_text(raw, "prompt")
        if isinstance(raw, str) or (raw and isinstance(raw[0], int)):
            prompts: list[Any] = [raw]
        else:
            prompts = list(raw)
        if not prompts:
            raise ApiError(400, "prompt must not be empty", "prompt", "invalid_value")
        out = []
        for p in prompts:
            try:
                out.append(self.engine.engine.tokenize(p))
            except ValueError as exc:
                raise invalid_prompt(exc, "prompt") from exc
        return out

    def _jobs(
        self, req: CompletionRequest, prompts: list[list[int]], structured: StructuredOutputsParams | None
    ) -> list[Job]:
        jobs = []
        max_tokens = DEFAULT_MAX_TOKENS if req.max_tokens is None else req.max_tokens
        for i, ids in enumerate(prompts):
            params = sampling_params(
                req,
                max_tokens=max_tokens,
                prompt_len=len(ids),
                max_model_len=self.engine.engine.max_model_len,
                kv_capacity=self.engine.kv_capacity,
                logprobs=req.logprobs,
                prompt_logprobs=req.logprobs if req.echo and req.logprobs is not None else None,
                structured=structured,
            )
            jobs.extend(
                Job(i * req.n + j, ids, choice_params(params, j), req.cache_salt, req.prefill_url) for j in range(req.n)
            )
        return jobs

    async def create(self, req: CompletionRequest, request: Request) -> JSONResponse | EventStream:
        prompts = self._prompts(req)
        structured = await compile_constraint(req, self.engine.engine.grammars)
        jobs = self._jobs(req, prompts, structured)
        rid = f"cmpl-{uuid.uuid4().hex}"
        record = access_record(request)
        record.request_id = rid
        record.prompt_tokens = sum(len(p) for p in prompts)  # known now: an aborted request's line says it too
        token_text = TokenText(self.engine.engine.tokenizer, req.return_tokens_as_token_ids)
        if req.stream:
            chunks = self._stream(req, jobs, rid, token_text, prompts, record)
            return EventStream(chunks)
        final = await until_disconnected(request, collect(self.engine, jobs, rid))
        choices = [self._choice(req, job.index, final[job.index], token_text) for job in jobs]
        counts = _usage_counts(req, prompts, final)
        record.set_usage(*counts)
        body = {
            "id": rid,
            "object": "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": choices,
            "usage": usage(*counts, final.values()),
        }
        return JSONResponse(body)

    def _choice(self, req: CompletionRequest, index: int, out: RequestOutput, token_text: TokenText) -> dict:
        text = out.text
        logprobs = None
        if req.echo:
            text = self.engine.engine.tokenizer.decode(out.prompt_token_ids) + text
        if req.logprobs is not None:
            ids, sampled, tops = list(out.token_ids), list(out.sampled_logprobs), list(out.logprobs or [])
            if req.echo:
                prompt_tops = out.prompt_logprobs or []
                prompt_sampled = [None] + [
                    dict(t).get(tok) for t, tok in zip(prompt_tops[1:], out.prompt_token_ids[1:], strict=False)
                ]
                ids = out.prompt_token_ids + ids
                sampled = prompt_sampled + sampled
                tops = list(prompt_tops) + tops  # prompt entries also carry the actual token
            logprobs = completion_logprobs(ids, sampled, tops, token_text)
        choice = {
            "index": index,
            "text": text,
            "logprobs": logprobs,
            "finish_reason": out.finish_reason,
            "stop_reason": out.stop_reason,
        }
        return with_spec(choice, out)

    async def _stream(
        self,
        req: CompletionRequest,
        jobs: list[Job],
        rid: str,
        token_text: TokenText,
        prompts: list[list[int]],
        record: AccessRecord,
    ) -> AsyncGenerator[dict[str, Any], None]:
        created = int(time.time())
        finals: dict[int, RequestOutput] = {}
        offsets: dict[int, int] = {}  # per choice: characters of the tokens already sent (text_offset is absolute)
        events = choice_deltas(self.engine, jobs, rid)
        async with contextlib.aclosing(events):
            async for index, text, new, out in events:
                record.count_output(index, len(out.token_ids))
                logprobs = None
                if req.logprobs is not None and out.logprobs is not None:
                    logprobs = completion_logprobs(
                        [out.token_ids[i] for i in new],
                        [out.sampled_logprobs[i] for i in new],
                        [out.logprobs[i] for i in new],
                        token_text,
                        offsets.get(index, 0),
                    )
                    offsets[index] = offsets.get(index, 0) + sum(len(piece) for piece in logprobs["tokens"])
                choice = {"index": index, "text": text, "logprobs": logprobs, "finish_reason": out.finish_reason}
                if out.finished:
                    choice["stop_reason"] = out.stop_reason
                    finals[index] = out
                yield {
                    "id": rid,
                    "object": "text_completion",
                    "created": created,
                    "model": self.model_name,
                    "choices": [with_spec(choice, out)],
                }
        counts = _usage_counts(req, prompts, finals)
        record.set_usage(*counts)
        if req.stream_options is not None and req.stream_options.include_usage:
            yield {
                "id": rid,
                "object": "text_completion",
                "created": created,
                "model": self.model_name,
                "choices": [],
                "usage": usage(*counts, finals.values()),
            }


def _usage_counts(
    req: CompletionRequest, prompts: list[list[int]], finals: dict[int, RequestOutput]
) -> tuple[int, int, int]:
    """(prompt, completion, cached) tokens: each prompt counted once, every choice's output counted."""
    cached = sum(finals[i * req.n].num_cached_tokens for i in range(len(prompts)))
    return sum(len(p) for p in prompts), sum(len(o.token_ids) for o in finals.values()), cached
