"""OpenAI request schemas (with vLLM's extensions) and the error body.

Validation is strict (no "5" for 5, no true for 1): a wrong type is a 422 with
the offending field named. Unknown fields are accepted and ignored, as OpenAI
clients send fields a server may not know.
"""

from __future__ import annotations

import hmac
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from kvwarden.engine.sampling_params import MAX_LOGPROBS


class ApiError(Exception):
    """An error that becomes ``{"error": {...}}`` with an HTTP status."""

    def __init__(
        self, status: int, message: str, param: str | None = None, code: str | None = None, err_type: str | None = None
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.err_type = err_type or ("invalid_request_error" if status < 500 else "server_error")

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.err_type, "param": self.param, "code": self.code}}


def error_response(err: ApiError) -> JSONResponse:
    """The error as OpenAI's JSON body with its status (503 says when to retry)."""
    headers = {"Retry-After": "1"} if err.status == 503 else None
    return JSONResponse(err.body(), status_code=err.status, headers=headers)


def api_key_error(authorization: str | None, key: str) -> ApiError | None:
    """401 unless ``authorization`` is ``Bearer <key>`` (compared in constant time)."""
    header = authorization or ""
    token = header[7:] if header.lower().startswith("bearer ") else ""
    if hmac.compare_digest(token.encode(), key.encode()):
        return None
    return ApiError(401, "missing or invalid API key", None, "invalid_api_key", "authentication_error")


# Fields that would change what the answer means: refused with a 400 naming the field rather than
# ignored, unless they carry the value that means "off". Harmless bookkeeping fields (user, metadata,
# store, ...) stay accepted and are ignored.
UNSUPPORTED_FIELDS: dict[str, tuple[str, tuple[Any, ...]]] = {
    "response_format": ("structured output is not supported", ({"type": "text"},)),
    "tools": ("tool calling is not supported", ([],)),
    "tool_choice": ("tool calling is not supported", ("none",)),
    "parallel_tool_calls": ("tool calling is not supported", (False,)),
    "functions": ("function calling is not supported", ([],)),
    "function_call": ("function calling is not supported", ("none",)),
    "logit_bias": ("logit_bias is not supported", ({},)),
    "presence_penalty": ("penalties are not supported (only 0)", (0, 0.0)),
    "frequency_penalty": ("penalties are not supported (only 0)", (0, 0.0)),
    "repetition_penalty": ("penalties are not supported (only 1)", (1, 1.0)),
    "best_of": ("best_of is not supported (only 1)", (1,)),
    "suffix": ("suffix (insertion) is not supported", ("",)),
    "structured_outputs": ("structured output is not supported", ()),
}
UNSUPPORTED_PREFIXES = ("guided_",)  # vLLM's guided decoding: guided_json, guided_regex, guided_choice, ...


def refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first field that would change what the answer means (see ``UNSUPPORTED_FIELDS``)."""
    values = {**{k: getattr(req, k) for k in type(req).model_fields}, **(req.model_extra or {})}
    for name, value in values.items():
        if value is None:
            continue
        if name in UNSUPPORTED_FIELDS:
            why, harmless = UNSUPPORTED_FIELDS[name]
            if value in harmless:
                continue
        elif name.startswith(UNSUPPORTED_PREFIXES):
            why = "guided decoding is not supported"
        else:
            continue
        raise ApiError(
            400,
            f"{name}: {why} by kvwarden; remove the field (it would change what the answer means, "
            "so it is refused rather than ignored)",
            name,
            "unsupported_parameter",
        )


class _Strict(BaseModel):
    model_config = ConfigDict(strict=True, extra="allow")


class StreamOptions(_Strict):
    include_usage: bool = False


StopField = str | list[str] | None


class KVTransferParams(_Strict):
    """Disaggregated serving: which prefill instance computes the prompt (a decode instance's requests)."""

    prefill_url: str


class _SamplingFields(_Strict):
    """Fields shared by completions and chat completions."""

    model: str
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_tokens: int = 0
    seed: int | None = None
    stop: StopField = None
    stop_token_ids: list[int] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    return_tokens_as_token_ids: bool = False
    cache_salt: str | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    kv_transfer_params: KVTransferParams | None = None

    @property
    def prefill_url(self) -> str | None:
        return self.kv_transfer_params.prefill_url if self.kv_transfer_params is not None else None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ContentPart(_Strict):
    type: Literal["text"]
    text: str


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True


class TokenizeRequest(_Strict):
    """``POST /tokenize`` (vLLM's shape): a ``prompt``, or chat ``messages`` rendered by the template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True  # the BOS rule the completion endpoints apply
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(_Strict):
    """``POST /detokenize`` (vLLM's shape)."""

    model: str | None = None
    tokens: list[int]
