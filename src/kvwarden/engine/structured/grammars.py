"""Compiling structured-output constraints against the model's tokenizer, once per constraint.

The grammar library is llguidance (``docs/structured.md`` has the measurements
behind the choice: xgrammar 0.2.8 lets raw control characters into JSON strings
with a length bound, which is invalid JSON). It is imported on the first
structured request, not at engine start. A constraint is checked and turned
into a template matcher once; each request gets a copy (microseconds). The
server compiles on a worker thread before the request is queued, so the
engine's step loop only finds templates in the cache.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvwarden.engine.structured.params import StructuredOutputsParams
from kvwarden.engine.structured.state import GrammarState

if TYPE_CHECKING:
    from kvwarden.models.tokenizer import Tokenizer


class GrammarError(ValueError):
    """A constraint the grammar library cannot compile; the message names the field."""


class Grammars:
    """Compiled constraints for one tokenizer, least recently used evicted past ``cache_size``.

    Thread-safe: the server compiles on worker threads while the engine thread reads the cache.
    """

    def __init__(self, tokenizer: Tokenizer, vocab_size: int, cache_size: int = 256) -> None:
        """Args:
        tokenizer: the model's tokenizer (its ``tokenizers`` backend and EOS ids).
        vocab_size: the width of the model's logits (it may exceed the tokenizer's vocabulary;
            ids past it are never allowed).
        cache_size: compiled constraints kept.
        """
        self._tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.eos_token_ids = tuple(tokenizer.eos_token_ids)
        # llguidance's mask where a grammar may end can allow the tokenizer's own end-of-text token beside the
        # EOS it was given: special tokens other than the model's EOS are cleared there (GrammarState.masks).
        added = tokenizer.backend.get_added_tokens_decoder()
        self._specials = tuple(sorted(i for i, t in added.items() if t.special and i not in self.eos_token_ids))
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self._lltok: Any = None
        self._cache: OrderedDict[StructuredOutputsParams, Any] = OrderedDict()
        self.compiled = 0  # compilations done (cache misses)
        self.hits = 0

    def compile(self, params: StructuredOutputsParams) -> Any:
        """The template matcher of ``params`` (cached).

        Raises:
            GrammarError: naming ``structured_outputs.<kind>`` with the library's reason.
        """
        with self._lock:
            if params in self._cache:
                self._cache.move_to_end(params)
                self.hits += 1
                return self._cache[params]
        import llguidance

        tokenizer = self._tokenizer_info()
        try:
            grammar = _grammar(params)
        except Exception as exc:  # the library's converters raise their own types for malformed input
            raise GrammarError(f"structured_outputs.{params.kind}: cannot be compiled: {exc}") from exc
        error = llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        if error:
            raise GrammarError(f"structured_outputs.{params.kind}: cannot be compiled: {error.strip()}")
        template = llguidance.LLMatcher(tokenizer, grammar, log_level=0)  # errors are raised, not printed
        if template.is_error():
            raise GrammarError(f"structured_outputs.{params.kind}: cannot be compiled: {template.get_error()}")
        if GrammarState(template.deep_copy(), self.vocab_size, self.eos_token_ids).dead_end():
            raise GrammarError(
                f"structured_outputs.{params.kind}: matches no text at all (the constraint's language is empty), "
                "so no answer could satisfy it"
            )
        with self._lock:
            self._cache[params] = template
            self.compiled += 1
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return template

    def state(self, params: StructuredOutputsParams) -> GrammarState:
        """A fresh matcher for one request (one per output of an ``n > 1`` request)."""
        template = self.compile(params)
        with self._lock:
            matcher = template.deep_copy()
        return GrammarState(matcher, self.vocab_size, self.eos_token_ids, self._specials)

    def _tokenizer_info(self) -> Any:
        with self._lock:
            if self._lltok is None:
                import llguidance

                self._lltok = llguidance.LLTokenizer(
                    self._tokenizer.backend.to_str(), n_vocab=self.vocab_size, eos_token=list(self.eos_token_ids)
                )
            return self._lltok


def _grammar(p: StructuredOutputsParams) -> str:
    """llguidance's grammar text of a constraint."""
    from llguidance import LLMatcher
    from llguidance.gbnf_to_lark import any_to_lark

    whitespace = {"whitespace_flexible": p.any_whitespace}
    if p.json is not None:
        return LLMatcher.grammar_from_json_schema(p.json, defaults=whitespace)
    if p.json_object:
        return LLMatcher.grammar_from_json_schema('{"type": "object"}', defaults=whitespace)
    if p.regex is not None:
        return LLMatcher.grammar_from_regex(p.regex)
    if p.choice is not None:
        # JSON string literals are valid Lark literals (same escapes): any choice text is matched exactly.
        return LLMatcher.grammar_from_lark("start: " + " | ".join(json.dumps(c, ensure_ascii=False) for c in p.choice))
    assert p.grammar is not None
    # Lark (llguidance's own syntax) or GBNF / EBNF with ``::=`` (xgrammar's and llama.cpp's), converted.
    return LLMatcher.grammar_from_lark(any_to_lark(p.grammar))
