"""Whether a server given by URL can be probed at all: reachable, and given the key it wants."""

from __future__ import annotations

import httpx


def check_reachable(url: str, api_key: str | None) -> None:
    """Stop at once, naming the flag, when the server cannot be reached or wants a key it was not given:
    otherwise every request of the run fails the same way and the table says so in a cut-off cell."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        status = httpx.get(f"{url.rstrip('/')}/v1/models", headers=headers, timeout=15).status_code
    except httpx.HTTPError as exc:
        raise ValueError(f"--url: cannot reach {url} ({type(exc).__name__}: {exc}); is the server running?") from exc
    if status in (401, 403) and not api_key:
        raise ValueError(f"--url: the server at {url} needs a key: pass --api-key (or set KVWARDEN_API_KEY)")
    if status in (401, 403):
        raise ValueError(f"--api-key: the server at {url} refused the key (HTTP {status})")
