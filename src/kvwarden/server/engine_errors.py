"""Why a request the engine thread served did not complete: the errors :class:`AsyncEngine` raises to
its callers, which the HTTP layer turns into OpenAI error bodies (``server/streams.py``)."""

from __future__ import annotations


class QueueFullError(RuntimeError):
    """Too many requests are waiting; the caller should retry later."""


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served (the cause is in the message)."""


class RequestTimeoutError(RuntimeError):
    """The request ran past the server's ``--request-timeout``; it was aborted and its blocks freed."""


class RequestFailedError(RuntimeError):
    """The engine ended the request mid-generation (a grammar with no way forward, non-finite logits);
    ``code`` names the kind, as the API reports it."""

    def __init__(self, message: str, code: str | None) -> None:
        super().__init__(message)
        self.code = code or "request_failed"


class RemotePrefillError(RuntimeError):
    """The prefill instance of a disaggregated request failed or refused it (decode role)."""


class PrefillTimeoutError(RemotePrefillError):
    """The prefill instance did not finish the prompt within ``--pd-transfer-timeout``."""
