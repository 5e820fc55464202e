"""An OpenAI-compatible server that answers instantly, to measure what a proxy in front of it costs.

Every completion is the same ``--tokens`` tokens with logprobs and kvwarden's
``spec_decoding`` statistics (a healthy generation the guard's monitors pass),
streamed as one chunk per token or returned whole. No model, no engine: the
time a client sees is the HTTP stack's and the proxy's alone.

    python -m kvwarden.bench.instant --port 8300 --tokens 16
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import AsyncIterator
from typing import Any

from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

MODEL = "instant"
SPEC = {"num_drafts": 8, "num_draft_tokens": 24, "num_accepted_tokens": 8, "accept_length": 2.0, "accept_rate": 0.33}


def _choice(i: int, streaming: bool, last: bool, tokens: int) -> dict[str, Any]:
    words = [f" w{j}" for j in range(tokens)] if not streaming else [f" w{i}"]
    logprobs = {"tokens": words, "token_logprobs": [-0.5] * len(words), "top_logprobs": [None] * len(words)}
    return {
        "index": 0,
        "text": "".join(words),
        "logprobs": logprobs,
        "finish_reason": "length" if last else None,
        "spec_decoding": SPEC,
    }


def build_app(tokens: int) -> Starlette:
    async def completions(request: Request) -> Response:
        body = await request.json()
        usage = {"prompt_tokens": 4, "completion_tokens": tokens, "total_tokens": 4 + tokens}
        head = {"id": "cmpl-instant", "object": "text_completion", "created": int(time.time()), "model": MODEL}
        if not body.get("stream"):
            return JSONResponse({**head, "choices": [_choice(0, False, True, tokens)], "usage": usage})

        async def events() -> AsyncIterator[str]:
            for i in range(tokens):
                yield f"data: {json.dumps({**head, 'choices': [_choice(i, True, i == tokens - 1, tokens)]})}\n\n"
            if (body.get("stream_options") or {}).get("include_usage"):
                yield f"data: {json.dumps({**head, 'choices': [], 'usage': usage})}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def health(_: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def models(_: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": MODEL, "object": "model", "owned_by": "bench"}]})

    return Starlette(
        routes=[
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/health", health, methods=["GET"]),
            Route("/v1/models", models, methods=["GET"]),
        ]
    )


def main() -> None:
    import uvicorn

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--tokens", type=int, default=16, help="tokens in every answer")
    args = p.parse_args()
    print(f"instant backend listening on http://127.0.0.1:{args.port}", flush=True)
    uvicorn.run(build_app(args.tokens), host="127.0.0.1", port=args.port, log_level="warning", access_log=False)


if __name__ == "__main__":
    main()
