"""``kvwarden guard`` in front of real kvwarden servers on loopback, two of them broken on purpose.

Three backends with n-gram speculation: one clean, one with ``kv-corruption``
(its KV is overwritten with noise after prefill: accept length collapses), one
with ``repetition`` (decoding forced into a loop: every draft is accepted).
Through the guard, every answer a client receives must equal the clean
backend's answer for that request, fingerprint for fingerprint, in all four
shapes (completions / chat, streaming or not); the monitors' aborts and the
retries are counted by reason; and the broken backends' KV pools return to
where they started, because closing the connection aborts the request there.

Requests use ``ignore_eos``: a generation that ends before the monitors'
128-token minimum is never judged (docs/guard.md), and the tiny random model
emits its end token at random.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from kvwarden.guard.canary import as_ids
from kvwarden.models.bundled import documents
from kvwarden.probe.client import parse_logprobs
from kvwarden.probe.fingerprint import fingerprint
from server_util import Server, running_guard, running_server

SPEC = json.dumps({"method": "ngram", "num_speculative_tokens": 3})
MAX_TOKENS = 160  # past the acceptance rule's 128-token minimum
MODES = ("completions", "completions-stream", "chat", "chat-stream")


@pytest.fixture(scope="module")
def backends(llama_tiny: Path) -> Iterator[dict[str, Server]]:
    model = str(llama_tiny)
    common = ["--speculative-config", SPEC, "--served-model-name", "tiny"]
    with ExitStack() as stack:
        yield {
            "clean": stack.enter_context(running_server(model, *common)),
            "corrupt": stack.enter_context(running_server(model, *common, "--inject-fault", "kv-corruption=1.0")),
            "loop": stack.enter_context(running_server(model, *common, "--inject-fault", "repetition=1.0")),
        }


def prompts(count: int) -> list[str]:
    docs = documents()
    return [" ".join(docs[i % len(docs)].text.split()[(i * 7) % 40 :][:40]) for i in range(count)]


Answer = tuple[str, list[list[tuple[Any, float]]], str | None]


def ask_all(url: str, mode: str, prompt: str, **extra: Any) -> dict[int, Answer]:
    """Per choice: (text, top-5 lists, finish reason) of one greedy request, parsed alike for every shape."""
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)
    body: dict[str, Any] = {"extra_body": {"ignore_eos": True}, "max_tokens": MAX_TOKENS, "temperature": 0.0}
    stream = mode.endswith("-stream")
    if mode.startswith("chat"):
        msgs = [{"role": "user", "content": prompt}]
        raw = client.chat.completions.create(
            model="tiny", messages=msgs, logprobs=True, top_logprobs=5, stream=stream, **body, **extra
        )
    else:
        raw = client.completions.create(model="tiny", prompt=prompt, logprobs=5, stream=stream, **body, **extra)
    out: dict[int, Answer] = {}
    for chunk in raw if stream else [raw]:
        for choice in chunk.choices:
            text, tops, finish = out.get(choice.index, ("", [], None))
            piece = choice.text if mode.startswith("completions") else (choice.delta if stream else choice.message)
            text += piece if isinstance(piece, str) else (piece.content or "")
            if choice.logprobs is not None:
                tops = tops + parse_logprobs(choice.logprobs.model_dump())[1]
            out[choice.index] = (text, tops, choice.finish_reason or finish)
    return out


def ask(url: str, mode: str, prompt: str, **extra: Any) -> Answer:
    return ask_all(url, mode, prompt, **extra)[0]


def wait_for(what: str, ok: Callable[[], bool], timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not ok():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def idle(server: Server) -> bool:
    m = server.metrics()
    return m["kvwarden:kv_blocks_used"] == 0 and m["kvwarden:num_requests_running"] == 0


def test_every_answer_equals_the_clean_backends(backends: dict[str, Server]) -> None:
    urls = [backends[k].url for k in ("corrupt", "loop", "clean")]
    with running_guard(urls, "--canary-interval", "1", "--max-retries", "2") as guard:
        cases = [(mode, p) for p, mode in zip(prompts(12), MODES * 3, strict=True)]
        for mode, prompt in cases:
            text, tops, finish = ask(guard.url, mode, prompt)
            want_text, want_tops, _ = ask(backends["clean"].url, mode, prompt)
            assert finish == "length", (mode, finish)
            assert len(tops) == MAX_TOKENS, mode
            assert fingerprint(as_ids(tops), text) == fingerprint(as_ids(want_tops), want_text), (mode, prompt)
        # n = 2: each choice is watched on its own; the answer is held until both pass the window.
        for stream in (False, True):
            mode = "completions-stream" if stream else "completions"
            got = ask_all(guard.url, mode, prompts(13)[-1], n=2, seed=5)
            assert got == ask_all(backends["clean"].url, "completions", prompts(13)[-1], n=2, seed=5)
            assert sorted(got) == [0, 1]
        m = guard.metrics()
        # Least-outstanding with round-robin ties: every backend got work, and each broken one was caught.
        for url in urls:
            assert m[f'kvwarden_guard:requests_total{{backend="{url}"}}'] >= 1
        assert m['kvwarden_guard:aborts_total{reason="acceptance"}'] >= 1
        assert m['kvwarden_guard:aborts_total{reason="repetition"}'] >= 1
        aborts = sum(v for k, v in m.items() if k.startswith("kvwarden_guard:aborts_total"))
        assert m["kvwarden_guard:retries_total"] == aborts  # every abort led to exactly one retry
        assert m['kvwarden_guard:answers_total{outcome="ok"}'] == len(cases) + 2
        # The determinism canary: the corrupted backend's fingerprint changes, the clean one's never does.
        drifting = f'kvwarden_guard:backend_drifting{{backend="{backends["corrupt"].url}"}}'
        wait_for("the canary to flag the corrupted backend", lambda: guard.metrics()[drifting] == 1.0)
        health = httpx.get(f"{guard.url}/health", timeout=10).json()
        by_url = {b["url"]: b for b in health["backends"]}
        clean = by_url[backends["clean"].url]
        assert clean["canary"]["runs"] >= 2 and not clean["drifting"] and clean["canary"]["changes"] == 0
        assert by_url[backends["corrupt"].url]["injected_faults"] == {"kv-corruption": 1.0}
    for name in ("corrupt", "loop"):
        server = backends[name]
        # Closing the connection aborted the request at the backend, and its KV went back to the pool.
        wait_for(f"{name}'s KV pool to return to baseline", lambda s=server: idle(s))
        assert server.metrics()['kvwarden:request_success_total{finished_reason="abort"}'] >= 1
        faulted = httpx.get(f"{server.url}/health", timeout=10).json()["faulted_requests"]
        assert sum(faulted.values()) >= 1


def test_an_abort_after_the_window_ends_the_stream_with_an_error(backends: dict[str, Server]) -> None:
    corrupt = backends["corrupt"]
    with running_guard([corrupt.url], "--hold-back-tokens", "0", "--max-retries", "0", "--canary-interval", "0") as g:
        body = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": MAX_TOKENS, "ignore_eos": True, "stream": True}
        with httpx.stream("POST", f"{g.url}/v1/completions", json=body, timeout=120) as resp:
            assert resp.status_code == 200
            events = [line[5:].strip() for line in resp.iter_lines() if line.startswith("data:")]
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])["error"]
        assert error["type"] == "guard_abort" and error["code"] == "acceptance", error
        finish = json.loads(events[-3])["choices"][0]
        assert finish["finish_reason"] == "guard_abort"
        streamed = [json.loads(e) for e in events[:-3]]
        assert sum(1 for c in streamed if c["choices"] and c["choices"][0]["text"]) > 64  # tokens flowed first
        assert all(c["choices"][0]["finish_reason"] is None for c in streamed if c["choices"])  # no silent end
        # The official client turns the error event into an exception: nobody mistakes the text for complete.
        with pytest.raises(openai.APIError, match="guard stopped this generation"):
            ask(g.url, "completions-stream", prompts(2)[1])
    wait_for("the corrupted backend's KV pool to return to baseline", lambda: idle(corrupt))


def test_when_every_attempt_fails_the_client_gets_an_openai_error(backends: dict[str, Server]) -> None:
    loop = backends["loop"]
    with running_guard([loop.url], "--max-retries", "1", "--canary-interval", "0") as g:
        health = f"{g.url}/health"  # the backend said it is invariant (canonical numerics) on its /health
        wait_for("the first health check", lambda: httpx.get(health, timeout=10).json()["backends"][0]["invariant"])
        for mode in ("completions", "chat-stream"):  # a stream that never passed its window is a plain error too
            with pytest.raises(openai.APIStatusError) as err:
                ask(g.url, mode, prompts(1)[0])
            assert err.value.status_code == 502
            body = err.value.response.json()["error"]
            # greedy on the one invariant backend: a retry there gives the same answer, so it fails once (#63 item 8)
            assert body["code"] == "repetition" and "1 attempt(s)" in body["message"], body
            assert "not retried on an invariant backend already tried" in body["message"], body
        m = g.metrics()
        assert m["kvwarden_guard:retries_total"] == 0 and m["kvwarden_guard:retries_skipped_total"] == 2
        # sampled without a seed, another attempt may answer otherwise: retried on the same backend
        sampled = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": MAX_TOKENS, "temperature": 0.9}
        resp = httpx.post(f"{g.url}/v1/completions", json={**sampled, "ignore_eos": True}, timeout=120)
        assert resp.status_code == 502 and "2 attempt(s)" in resp.json()["error"]["message"], resp.text  # loops
        m = g.metrics()
        assert m["kvwarden_guard:retries_total"] == 1 and m["kvwarden_guard:retries_skipped_total"] == 2
        assert m['kvwarden_guard:answers_total{outcome="error"}'] == 3
        # Bad input is the client's error: passed through as the backend gave it, not retried.
        resp = httpx.post(f"{g.url}/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": -1})
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "max_tokens", resp.text
        assert g.metrics()["kvwarden_guard:retries_total"] == 1
        resp = httpx.post(f"{g.url}/v1/completions", content=b"{not json")
        assert resp.status_code == 400 and resp.json()["error"]["code"] == "invalid_json"
    wait_for("the looping backend's KV pool to return to baseline", lambda: idle(loop))


def test_a_backend_that_stops_answering_is_taken_out_and_probed_back_in(
    backends: dict[str, Server], llama_tiny: Path, tmp_path: Path
) -> None:
    config = tmp_path / "guard.toml"
    config.write_text("request_timeout = 3.0\nhealth_interval = 0.3\n[canary]\ninterval = 0.0\n")
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    with running_server(str(llama_tiny), "--served-model-name", "tiny") as spare:
        urls = [backends["clean"].url, spare.url, dead]
        with running_guard(urls, "--config", str(config)) as g:
            os.kill(spare.process.pid, signal.SIGSTOP)  # alive but silent, as a wedged server is
            try:
                up = f'kvwarden_guard:backend_up{{backend="{spare.url}"}}'
                wait_for("the silent backend to be taken out", lambda: g.metrics()[up] == 0.0)
                for prompt in prompts(3):
                    text, _, finish = ask(g.url, "completions", prompt)
                    assert finish == "length" and text
                health = httpx.get(f"{g.url}/health", timeout=10).json()
                state = {b["url"]: b["up"] for b in health["backends"]}
                assert state == {backends["clean"].url: True, spare.url: False, dead: False}
            finally:
                os.kill(spare.process.pid, signal.SIGCONT)
            wait_for("the backend to be probed back in", lambda: g.metrics()[up] == 1.0)
            assert g.metrics()[f'kvwarden_guard:backend_up{{backend="{dead}"}}'] == 0.0


def test_a_client_that_goes_away_frees_everything(backends: dict[str, Server], tmp_path: Path) -> None:
    clean = backends["clean"]
    # With the monitors off the answer runs to its length, so a hang-up timed against it lands mid-generation
    # (with them on, this random model's loops end every attempt early and the guard answers 502).
    quiet = tmp_path / "quiet.toml"
    quiet.write_text("".join(f"[monitors.{m}]\nenabled = false\n" for m in ("acceptance", "repetition", "garbage")))
    for hold in ("0", "128"):  # gone after the first tokens, and gone while the guard still holds them back
        flags = ("--config", str(quiet)) if hold != "0" else ()
        with running_guard([clean.url], "--hold-back-tokens", hold, "--canary-interval", "0", *flags) as g:
            body = {"model": "tiny", "prompt": prompts(1)[0], "max_tokens": 2000, "ignore_eos": True, "stream": True}
            with httpx.Client(timeout=30) as client:
                if hold == "0":
                    with client.stream("POST", f"{g.url}/v1/completions", json=body) as resp:
                        for _ in zip(range(5), resp.iter_lines(), strict=False):
                            pass  # read a few chunks, then hang up
                else:
                    # hang up a quarter of the way through, timed on this machine rather than a fixed number
                    # of seconds (the CPU kernels make this model's 2,000 tokens take well under one)
                    whole = {**body, "stream": False}
                    started = time.monotonic()
                    assert client.post(f"{g.url}/v1/completions", json=whole).status_code == 200
                    seconds = time.monotonic() - started
                    with pytest.raises(httpx.ReadTimeout):
                        client.post(f"{g.url}/v1/completions", json=whole, timeout=seconds / 4)
            outstanding = f'kvwarden_guard:backend_outstanding_requests{{backend="{clean.url}"}}'
            wait_for("the guard to let go of the backend", lambda g=g, name=outstanding: g.metrics()[name] == 0.0)
            wait_for("the backend's KV pool to return to baseline", lambda: idle(clean))
            # its log line names the attempt the client left, never "no attempt" (#63 item 14)
            how = "ok, then the client left mid-stream" if hold == "0" else "the client left"
            left = f": 499, {clean.url}: {how}"
            wait_for("the guard's log line", lambda g=g, left=left: any(left in line for line in list(g.log)))
            assert not [line for line in list(g.log) if ": 499, no attempt" in line]


def test_no_backend_up_names_what_the_health_checks_saw(tmp_path: Path) -> None:
    dead = "http://127.0.0.1:9"  # the discard port: nothing listens there
    config = tmp_path / "guard.toml"
    config.write_text("health_interval = 0.3\n[canary]\ninterval = 0.0\n")
    with running_guard([dead], "--config", str(config)) as g:
        wait_for(
            "the health check", lambda: httpx.get(f"{g.url}/health", timeout=10).json()["backends"][0].get("last_error")
        )
        body = {"model": "tiny", "prompt": "hi", "max_tokens": 2}
        resp = httpx.post(f"{g.url}/v1/completions", json=body, timeout=30)
        assert resp.status_code == 503, resp.text
        message = resp.json()["error"]["message"]
        assert "no attempt" not in message and f"{dead}: /health: ConnectError" in message, message


def test_the_guard_checks_its_own_clients(backends: dict[str, Server], tmp_path: Path) -> None:
    config = tmp_path / "guard.toml"
    config.write_text('client_api_key = "sesame"\nmax_body_bytes = 4096\n[canary]\ninterval = 0.0\n')
    with running_guard([backends["clean"].url], "--config", str(config)) as g:
        body = {"model": "tiny", "prompt": "hello", "max_tokens": 2}
        resp = httpx.post(f"{g.url}/v1/completions", json=body, timeout=60)
        assert resp.status_code == 401 and resp.json()["error"]["code"] == "invalid_api_key"
        assert httpx.get(f"{g.url}/v1/models", timeout=10).status_code == 401
        key = {"Authorization": "Bearer sesame"}
        resp = httpx.post(f"{g.url}/v1/completions", json=body, headers=key, timeout=60)
        assert resp.status_code == 200, resp.text
        big = {**body, "prompt": "x " * 4096}
        resp = httpx.post(f"{g.url}/v1/completions", json=big, headers=key, timeout=60)
        assert resp.status_code == 413 and resp.json()["error"]["code"] == "body_too_large"
        assert httpx.get(f"{g.url}/health", timeout=10).status_code == 200  # health and metrics stay open
        # a misspelt field is refused by the guard itself (a backend such as vLLM would ignore it), named
        for name in ("max_token", "temprature"):
            resp = httpx.post(f"{g.url}/v1/completions", json={**body, name: 1}, headers=key, timeout=60)
            assert resp.status_code == 400 and resp.json()["error"]["param"] == name, resp.text
        # fields some backends support and kvwarden does not pass through to be answered there
        resp = httpx.post(f"{g.url}/v1/completions", json={**body, "min_p": 0.1}, headers=key, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["param"] == "min_p", resp.text
        resp = httpx.post(f"{g.url}/v1/completions", content=b'{"model": ', headers=key, timeout=60)
        assert resp.status_code == 400 and resp.json()["error"]["message"].startswith("malformed JSON body")
        # every request is one log line with its id and status, the guard's own refusals included
        time.sleep(0.3)
        lines = [line for line in g.log if "/v1/completions" in line]
        assert any(re.search(r"guard-[0-9a-f]{12} /v1/completions: 400, refused: Unrecognized", x) for x in lines)
        assert any(re.search(r"guard-[0-9a-f]{12} /v1/completions json: 200, ", x) for x in lines), lines
        assert any(re.search(r": 400, \S+: 400, passed through", x) for x in lines), lines  # min_p: the backend's
        assert any("400, refused: malformed JSON body" in x for x in lines)
        # Prometheus series exist at 0 before their first event
        metrics = httpx.get(f"{g.url}/metrics", timeout=10).text
        for reason in ("acceptance", "repetition", "garbage"):
            assert f'kvwarden_guard:aborts_total{{reason="{reason}"}} 0.0' in metrics
        clean = backends["clean"].url
        assert f'kvwarden_guard:backend_failures_total{{backend="{clean}"}} 0.0' in metrics


def test_a_non_streaming_answer_through_the_guard_is_the_backends_field_for_field(backends: dict[str, Server]) -> None:
    """stop_reason kept, text_offset absolute (the guard assembles the backend's stream)."""
    with running_guard([backends["clean"].url], "--canary-interval", "0") as g:
        body = {"model": "tiny", "prompt": "The cat", "max_tokens": 8, "logprobs": 2, "temperature": 0.0}
        direct = httpx.post(f"{backends['clean'].url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        guarded = httpx.post(f"{g.url}/v1/completions", json=body, timeout=60).json()["choices"][0]
        assert "stop_reason" in guarded and guarded["stop_reason"] == direct["stop_reason"]
        assert guarded["logprobs"]["text_offset"] == direct["logprobs"]["text_offset"]
        assert guarded["logprobs"]["text_offset"] == sorted(guarded["logprobs"]["text_offset"])
        assert guarded["text"] == direct["text"]
