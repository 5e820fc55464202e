"""The served model's own tokenizer, through the server's ``/tokenize`` (kvwarden's and vLLM's).

``probe --url`` often has no local copy of the server's tokenizer; without one,
the built-in scenarios' lengths (``--a-len``, ``--b-len``, ``--shared``) could
only be counted in words, which a server turns into several times as many
tokens - and the block arithmetic the scenarios aim at misses. With this, the
prompts are exact token-id lists again.
"""

from __future__ import annotations

import httpx


class RemoteTokenizer:
    """``encode`` through ``POST {url}/tokenize`` (no special tokens: the prompts are raw token ids)."""

    def __init__(self, url: str, model: str | None, api_key: str | None) -> None:
        self.url = url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    def encode(self, text: str) -> list[int]:
        body: dict[str, object] = {"prompt": text, "add_special_tokens": False}
        if self.model:
            body["model"] = self.model
        resp = httpx.post(f"{self.url}/tokenize", json=body, headers=self.headers, timeout=30)
        resp.raise_for_status()
        tokens = resp.json()["tokens"]
        if not isinstance(tokens, list) or not all(isinstance(t, int) for t in tokens):
            raise ValueError(f"{self.url}/tokenize: 'tokens' is not a list of token ids")
        return tokens

    @classmethod
    def reach(cls, url: str, model: str | None, api_key: str | None) -> tuple[RemoteTokenizer | None, str]:
        """The server's tokenizer when its ``/tokenize`` answers, else None and why."""
        tok = cls(url, model, api_key)
        try:
            tok.encode("hello world")
        except (httpx.HTTPError, KeyError, ValueError) as exc:
            return None, f"{type(exc).__name__}: {exc}"
        return tok, ""
