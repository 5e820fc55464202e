"""OpenAI request schemas (with vLLM's extensions) and the error body.

Validation is strict (no "5" for 5, no true for 1): a wrong type is a 422 with
the offending field named. A field kvwarden does not know is a 400 naming it,
as OpenAI's API answers "Unrecognized request argument supplied": a misspelt
``temprature`` would otherwise change the answer without anyone being told.
Fields that cannot change an answer (``IGNORED_FIELDS``: bookkeeping such as
``user`` or ``metadata``) are accepted and ignored; fields that would change it
and are not supported are refused by name (``UNSUPPORTED_FIELDS``).
"""

from __future__ import annotations

import hmac
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field
from starlette.responses import JSONResponse

from kvwarden.engine.sampling_params import MAX_LOGPROBS
from kvwarden.server.structured import GUIDED_FIELDS, ResponseFormat, StructuredOutputsField
from kvwarden.server.tool_protocol import ToolCall, ToolChoice, ToolDef


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
    "functions": ("the legacy functions field is not supported: use tools", ([],)),
    "function_call": ("the legacy function_call field is not supported: use tool_choice", ("none",)),
    "logit_bias": ("logit_bias is not supported", ({},)),
    "presence_penalty": ("penalties are not supported (only 0)", (0, 0.0)),
    "frequency_penalty": ("penalties are not supported (only 0)", (0, 0.0)),
    "repetition_penalty": ("penalties are not supported (only 1)", (1, 1.0)),
    "best_of": ("best_of is not supported (only 1)", (1,)),
    "suffix": ("suffix (insertion) is not supported", ("",)),
}
UNSUPPORTED_FIELDS |= {
    "prompt_logprobs": ("prompt_logprobs is not supported as a field: use echo with logprobs", ()),
    "min_p": ("min_p is not supported (only 0)", (0, 0.0)),
    "use_beam_search": ("beam search is not supported", (False,)),
    "length_penalty": ("length_penalty is not supported (only 1)", (1, 1.0)),
    "logprobs_mode": ("logprobs_mode is not supported (raw logprobs only)", ("raw_logprobs",)),
    "spaces_between_special_tokens": ("spaces_between_special_tokens is not supported (only true)", (True,)),
    "truncate_prompt_tokens": ("prompt truncation is not supported", ()),
    "audio": ("audio output is not supported", ()),
    "modalities": ("modalities other than text are not supported", (["text"],)),
    "prediction": ("predicted outputs are not supported", ()),
    "reasoning_effort": ("reasoning_effort is not supported", ()),
    "web_search_options": ("web search is not supported", ()),
    "verbosity": ("verbosity is not supported", ()),
    # vLLM's extensions kvwarden does not implement
    "chat_template": ("a request-supplied chat_template is not supported", ()),
    "continue_final_message": ("continue_final_message is not supported", (False,)),
    "allowed_token_ids": ("allowed_token_ids is not supported", ([],)),
    "bad_words": ("bad_words is not supported", ([],)),
    "documents": ("documents are not supported", ([],)),
    "mm_processor_kwargs": ("multimodal inputs are not supported", ({},)),
}
# Chat-only fields sent to /v1/completions: refused as unsupported there (a prompt has no tool turns to read).
CHAT_ONLY_FIELDS = ("tools", "tool_choice", "parallel_tool_calls", "chat_template_kwargs")
UNSUPPORTED_PREFIXES = ("guided_",)  # vLLM's guided decoding fields other than GUIDED_FIELDS
# Accepted and ignored: they cannot change an answer (OpenAI's bookkeeping, vLLM's scheduling hints).
IGNORED_FIELDS = frozenset(
    {"metadata", "store", "service_tier", "prompt_cache_key", "safety_identifier", "priority", "request_id"}
)
# Keys of a chat message that a client may send back from an earlier response; they cannot change the answer
# when empty, and the chat template does not read them.
IGNORED_MESSAGE_FIELDS = frozenset({"refusal", "annotations", "reasoning_content", "reasoning"})


def require_text(value: Any, field: str) -> None:
    """400 naming ``field`` (``messages[1].content``, ``prompt[0]``) for text that is not valid Unicode: a lone
    surrogate (``"\\ud800"``, which JSON can carry) cannot be encoded as UTF-8, so no tokenizer can read it."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise ApiError(
                400, f"{field}: not valid Unicode text ({exc.reason} at character {exc.start})", field, "invalid_value"
            ) from exc
    elif isinstance(value, list):
        for i, item in enumerate(value):
            require_text(item, f"{field}[{i}]")
    elif isinstance(value, ChatMessage):
        parts = value.content if isinstance(value.content, list) else [value.content]
        for i, part in enumerate(parts):
            inner = part.text if isinstance(part, ContentPart) else part
            require_text(inner, f"{field}.content" + (f"[{i}].text" if isinstance(value.content, list) else ""))
        require_text(value.name, f"{field}.name")


def refuse_unsupported(req: BaseModel) -> None:
    """400 naming the first field that would change what the answer means (``UNSUPPORTED_FIELDS``) or that
    kvwarden does not know at all (a misspelt ``max_token`` included)."""
    values = {**{k: getattr(req, k) for k in type(req).model_fields}, **(req.model_extra or {})}
    for name, value in values.items():
        if value is None:
            continue
        if name in CHAT_ONLY_FIELDS and name in (req.model_extra or {}):
            why = "tool calling and chat templates are only on /v1/chat/completions; this field is not supported"
        elif name in UNSUPPORTED_FIELDS:
            why, harmless = UNSUPPORTED_FIELDS[name]
            if value in harmless:
                continue
        elif name.startswith(UNSUPPORTED_PREFIXES) and name not in GUIDED_FIELDS:
            implemented = ", ".join(GUIDED_FIELDS)
            why = f"this guided decoding option (of vLLM's, only {implemented} are implemented) is not supported"
        else:
            continue
        raise ApiError(
            400,
            f"{name}: {why} by kvwarden; remove the field (it would change what the answer means, "
            "so it is refused rather than ignored)",
            name,
            "unsupported_parameter",
        )
    refuse_unknown(req)


def refuse_unknown(req: BaseModel) -> None:
    """400 naming a field kvwarden does not know (top level or inside an object), bookkeeping fields aside."""
    for name in req.model_extra or {}:
        if name not in UNSUPPORTED_FIELDS and not name.startswith(UNSUPPORTED_PREFIXES) and name not in IGNORED_FIELDS:
            raise unrecognized(name)
    for field_name in type(req).model_fields:
        _refuse_nested(getattr(req, field_name), field_name)


def unrecognized(name: str) -> ApiError:
    """OpenAI's answer to a field it does not know: a 400 naming it."""
    return ApiError(
        400,
        f"Unrecognized request argument supplied: {name} (kvwarden refuses fields it does not know rather than "
        "ignore them; see docs/api.md for the fields it accepts)",
        name,
        "unrecognized_argument",
    )


def _refuse_nested(value: Any, path: str) -> None:
    """Unknown keys inside objects (``stream_options``, ``messages[i]``, content parts) are refused too."""
    if isinstance(value, list):
        for i, item in enumerate(value):
            _refuse_nested(item, f"{path}[{i}]")
        return
    if not isinstance(value, BaseModel):
        return
    if isinstance(value, ContentPart) and value.type != "text":
        raise ApiError(
            400, f"{path}.type: content parts of type {value.type!r} are not supported: kvwarden serves text "
            "models; send text parts ({\"type\": \"text\", \"text\": ...})", f"{path}.type", "unsupported_content",
        )  # fmt: skip
    if isinstance(value, ContentPart) and value.text is None:
        raise ApiError(400, f"{path}.text: a text part needs its text", f"{path}.text", "invalid_value")
    for name, extra in (value.model_extra or {}).items():
        empty = extra is None or extra == [] or extra == ""
        if isinstance(value, ChatMessage) and name in IGNORED_MESSAGE_FIELDS and empty:
            continue
        raise unrecognized(f"{path}.{name}")
    for name in type(value).model_fields:
        _refuse_nested(getattr(value, name), f"{path}.{name}")


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
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None

    @property
    def prefill_url(self) -> str | None:
        return self.kv_transfer_params.prefill_url if self.kv_transfer_params is not None else None


class CompletionRequest(_SamplingFields):
    """``POST /v1/completions``."""

    prompt: str | list[int] | list[str] | list[list[int]]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)


class ContentPart(_Strict):
    type: str  # only "text" is served; another type is refused by name (_refuse_nested), not a schema error
    text: str | None = None


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None  # an assistant's calls, sent back in the conversation
    tool_call_id: str | None = None  # a tool message: the call it answers

    def text(self) -> str:
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(part.text or "" for part in self.content)


class ChatCompletionRequest(_SamplingFields):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    tools: list[ToolDef] | None = None
    tool_choice: ToolChoice | None = None
    parallel_tool_calls: bool | None = None
    chat_template_kwargs: dict[str, Any] | None = None  # passed to the template (e.g. enable_thinking)


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


def unknown_field(body: dict[str, Any], chat: bool) -> str | None:
    """The first top-level field of a raw request body that no OpenAI-compatible server knows (the guard's
    check: it fronts servers that support more than kvwarden, so only names nobody knows are refused)."""
    known = set((ChatCompletionRequest if chat else CompletionRequest).model_fields) | set(UNSUPPORTED_FIELDS)
    known |= IGNORED_FIELDS
    return next((k for k in body if k not in known and not k.startswith(UNSUPPORTED_PREFIXES)), None)
