"""Grammar libraries for structured outputs, measured: compile time, mask time, and whether outputs are valid.

For each tokenizer (kvwarden's llama-small: 2k tokens; SmolLM2: 49k) and each library that imports
(llguidance - kvwarden's choice -, xgrammar, outlines-core; ``pip install -e '.[grammar-bench]'`` for the
other two), the same constraints are compiled and then walked: at every step the library's mask is
computed and a seeded random allowed token taken, until the grammar ends. A random walk is the worst
case for a mask (any allowed token, not the likely ones) and finds what a model would only rarely hit:
every finished walk of the JSON schema is parsed and checked against the schema. Last, kvwarden's
own engine generates with and without a constraint to show the mask's cost per output token.

Prints a table and ends with one JSON line.

    kvwarden bench grammar_backends                  # both tokenizers (~2 min)
    kvwarden bench grammar_backends --quick          # llama-small only, fewer walks
"""

from __future__ import annotations

import argparse
import json
import random
import re
import sys
import time
from typing import Any

import numpy as np

from kvwarden import LLM, SamplingParams, StructuredOutputsParams
from kvwarden.bench import workloads

DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
INVOICE = {  # bounded strings: the case where xgrammar 0.2.8 admits raw control characters
    "type": "object",
    "properties": {
        "date": {"type": "string", "pattern": f"^{DATE}$"},
        "amount": {"type": "integer", "minimum": 0, "maximum": 99999},
        "currency": {"enum": ["EUR", "HUF", "USD"]},
        "note": {"type": "string", "maxLength": 6},
    },
    "required": ["date", "amount", "currency", "note"],
    "additionalProperties": False,
}
CONSTRAINTS = {"invoice schema": ("json", json.dumps(INVOICE)), "date regex": ("regex", DATE)}


def schema_valid(text: str) -> bool:
    """Parsed by Python's json and accepted by INVOICE (what a client would check)."""
    try:
        v = json.loads(text)
    except json.JSONDecodeError:
        return False
    return (
        isinstance(v, dict)
        and list(v) == ["date", "amount", "currency", "note"]
        and re.fullmatch(DATE, v["date"]) is not None
        and isinstance(v["amount"], int)
        and 0 <= v["amount"] <= 99999
        and v["currency"] in ("EUR", "HUF", "USD")
        and isinstance(v["note"], str)
        and len(v["note"]) <= 6
    )


class Llguidance:
    name = "llguidance"

    def __init__(self, llm: LLM) -> None:
        import llguidance

        self.ll = llguidance
        self.vocab = llm.engine.model_config.vocab_size
        self.eos = list(llm.tokenizer.eos_token_ids)
        self.tok = llguidance.LLTokenizer(llm.tokenizer.backend.to_str(), n_vocab=self.vocab, eos_token=self.eos)

    def compile(self, kind: str, spec: str) -> Any:
        m = self.ll.LLMatcher
        grammar = m.grammar_from_json_schema(spec, defaults={"whitespace_flexible": False}) if kind == "json" else (
            m.grammar_from_regex(spec))  # fmt: skip
        return m(self.tok, grammar, log_level=0)

    def start(self, template: Any) -> Any:
        from llguidance.numpy import allocate_token_bitmask

        return template.deep_copy(), allocate_token_bitmask(1, self.vocab)

    def fill(self, state: Any) -> np.ndarray:
        from llguidance.numpy import fill_next_token_bitmask

        matcher, bitmask = state
        fill_next_token_bitmask(matcher, bitmask, 0)
        return bitmask[0]

    def ids(self, words: np.ndarray) -> np.ndarray:
        return _allowed_ids(words, self.vocab)

    def advance(self, state: Any, token: int) -> None:
        state[0].consume_token(token)


class Xgrammar:
    name = "xgrammar"

    def __init__(self, llm: LLM) -> None:
        import xgrammar as xgr
        from transformers import PreTrainedTokenizerFast

        self.xgr = xgr
        self.vocab = llm.engine.model_config.vocab_size
        self.eos = list(llm.tokenizer.eos_token_ids)
        hf = PreTrainedTokenizerFast(tokenizer_object=llm.tokenizer.backend)
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=self.vocab, stop_token_ids=self.eos)
        self.compiler = xgr.GrammarCompiler(info, cache_enabled=False)

    def compile(self, kind: str, spec: str) -> Any:
        if kind == "json":
            return self.compiler.compile_json_schema(spec, any_whitespace=False)
        return self.compiler.compile_regex(spec)

    def start(self, compiled: Any) -> Any:
        return self.xgr.GrammarMatcher(compiled), self.xgr.allocate_token_bitmask(1, self.vocab)

    def fill(self, state: Any) -> Any:
        matcher, bitmask = state
        matcher.fill_next_token_bitmask(bitmask)
        return bitmask[0]

    def ids(self, words: Any) -> np.ndarray:
        return _allowed_ids(words.numpy(), self.vocab)

    def advance(self, state: Any, token: int) -> None:
        state[0].accept_token(token)


class OutlinesCore:
    name = "outlines-core"

    def __init__(self, llm: LLM) -> None:
        import outlines_core as oc

        self.oc = oc
        self.vocab = llm.engine.model_config.vocab_size
        self.eos = list(llm.tokenizer.eos_token_ids)
        backend = llm.tokenizer.backend
        specials = {i for i, t in backend.get_added_tokens_decoder().items() if t.special}
        words: dict[bytes, list[int]] = {}
        for i in range(backend.get_vocab_size()):
            if i not in specials:  # the vocabulary holds tokens as raw bytes (byte-level BPE decoded)
                words.setdefault(_raw_bytes(backend.id_to_token(i)), []).append(i)
        self.vocabulary = oc.Vocabulary(self.eos[0], words)

    def compile(self, kind: str, spec: str) -> Any:
        regex = self.oc.json_schema.build_regex_from_schema(spec) if kind == "json" else spec
        return self.oc.Index(regex, self.vocabulary)

    def start(self, index: Any) -> Any:
        return self.oc.Guide(index)

    def fill(self, guide: Any) -> list[int]:
        return guide.get_tokens()  # allowed ids, straight from the index

    def ids(self, allowed: list[int]) -> list[int]:
        return allowed

    def advance(self, guide: Any, token: int) -> None:
        guide.advance(token)


def walk(backend: Any, compiled: Any, rng: random.Random, limit: int) -> tuple[list[int], float, int]:
    """One random walk: at each step the library's mask (timed), then a seeded random allowed token, until
    an EOS, no allowed token, or ``limit`` tokens. Returns the tokens, seconds spent in masks, masks made."""
    state, out, spent = backend.start(compiled), [], 0.0
    for _ in range(limit):
        t0 = time.perf_counter()
        mask = backend.fill(state)
        spent += time.perf_counter() - t0
        allowed = backend.ids(mask)
        token = int(allowed[rng.randrange(len(allowed))]) if len(allowed) else -1
        if token in backend.eos or token < 0:
            break
        backend.advance(state, token)
        out.append(token)
    return out, spent, len(out) + 1


def _allowed_ids(words: np.ndarray, vocab: int) -> np.ndarray:
    """The allowed ids of a packed int32 bitmask row (bit ``i % 32`` of word ``i // 32``)."""
    bits = np.unpackbits(words.astype("<i4").view(np.uint8), bitorder="little")[:vocab]
    return np.flatnonzero(bits)


def _raw_bytes(token: str) -> bytes:
    """A byte-level BPE token's bytes (GPT-2's byte-to-unicode table inverted)."""
    table = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    chars, n = table[:], 0
    for b in range(256):
        if b not in table:
            table.append(b)
            chars.append(256 + n)
            n += 1
    decode = {chr(c): b for b, c in zip(table, chars, strict=True)}
    return bytes(decode.get(ch, ord(ch) & 0xFF) for ch in token)


def measure(backend_cls: type, llm: LLM, model: str, walks: int) -> list[dict]:
    t0 = time.perf_counter()
    try:
        backend = backend_cls(llm)
    except ImportError as exc:
        print(f"  {backend_cls.name}: not installed ({exc.name}); pip install -e '.[grammar-bench]'", file=sys.stderr)
        return []
    setup = time.perf_counter() - t0
    rows = []
    for label, (kind, spec) in CONSTRAINTS.items():
        t0 = time.perf_counter()
        compiled = backend.compile(kind, spec)
        compile_s = time.perf_counter() - t0
        rng, masks, spent, invalid, unfinished = random.Random(0), 0, 0.0, [], 0
        for _ in range(walks):
            tokens, seconds, steps = walk(backend, compiled, rng, 200)
            masks, spent = masks + steps, spent + seconds
            text = llm.tokenizer.decode(tokens)
            ok = schema_valid(text) if kind == "json" else re.fullmatch(DATE, text) is not None
            if len(tokens) >= 200:
                unfinished += 1
            elif not ok:
                invalid.append(text)
        rows.append({"model": model, "library": backend.name, "constraint": label, "setup_s": setup,
                     "compile_ms": compile_s * 1e3, "mask_us": spent / masks * 1e6, "walks": walks,
                     "invalid": len(invalid), "unfinished": unfinished, "example_invalid": invalid[:1]})  # fmt: skip
    return rows


# A long JSON array of integers: it cannot end within max_tokens, so both runs make the same number of
# tokens and every one of them goes through a JSON mask.
LONG_ARRAY = {"type": "array", "items": {"type": "integer"}, "minItems": 200}


def engine_cost(llm: LLM, model: str, n: int) -> dict:
    """Output tok/s of kvwarden's engine with and without a JSON constraint, same token counts."""
    prompts = [list(r.prompt) for r in workloads.uniform(n, (64, 128), (48, 48), llm.tokenizer.vocab_size, 0)]
    so = StructuredOutputsParams(json=LONG_ARRAY, any_whitespace=False)
    llm.engine.grammars.compile(so)  # compiled before the clock starts, as the server does
    out: dict = {"model": model}
    # Twice each, alternating, best kept: the first run of a shape pays one-time costs (N1's per-weight
    # row-count measurement, allocations) that would otherwise land on whichever went first.
    for label, params in (("free", None), ("json", so)) * 2:
        sp = SamplingParams(
            temperature=1.0, seed=1, max_tokens=48, ignore_eos=params is None, structured_outputs=params
        )
        t0 = time.perf_counter()
        outs = llm.generate(prompts, sp)
        seconds = time.perf_counter() - t0
        out[f"{label}_tokens"] = sum(len(o.token_ids) for o in outs)
        out[f"{label}_tok_s"] = max(out.get(f"{label}_tok_s", 0.0), out[f"{label}_tokens"] / seconds)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["builtin:llama-small", "smollm2"])
    p.add_argument("--walks", type=int, default=30, help="random walks per constraint and library")
    p.add_argument("--requests", type=int, default=16, help="requests for the engine's with/without run")
    p.add_argument("--quick", action="store_true", help="llama-small only, 5 walks, 4 requests")
    args = p.parse_args()
    if args.quick:
        args.models, args.walks, args.requests = ["builtin:llama-small"], 5, 4
    rows, engine = [], []
    for model in args.models:
        llm = LLM(model)
        for backend_cls in (Llguidance, Xgrammar, OutlinesCore):
            print(f"measuring {backend_cls.name} on {model} ...", file=sys.stderr)
            rows += measure(backend_cls, llm, model, args.walks)
        engine.append(engine_cost(llm, model, args.requests))
    print(f"{'model':<22} {'library':<14} {'constraint':<15} {'setup s':>8} {'compile ms':>11} {'mask µs':>9} invalid")
    for r in rows:
        print(f"{r['model']:<22} {r['library']:<14} {r['constraint']:<15} {r['setup_s']:>8.2f} "
              f"{r['compile_ms']:>11.1f} {r['mask_us']:>9.1f} {r['invalid']:>4}/{r['walks']:<4}")  # fmt: skip
        if r["example_invalid"]:
            print(f"{'':<22} e.g. {r['example_invalid'][0]!r}")
    for e in engine:
        print(f"kvwarden engine on {e['model']}: {e['free_tok_s']:.1f} output tok/s unconstrained, "
              f"{e['json_tok_s']:.1f} with a JSON schema ({e['json_tok_s'] / e['free_tok_s']:.2f}x)")  # fmt: skip
    print(json.dumps({"bench": "grammar_backends", "rows": rows, "engine": engine}))


if __name__ == "__main__":
    main()
