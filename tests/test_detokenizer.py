"""Incremental detokenization gives a full decode's text after every token (engine/detokenizer.py).

Real tokenizers of three decoder families: the byte-level BPE every made checkpoint carries (incomplete
UTF-8 across tokens), a SentencePiece-style one (Metaspace: a window's first token loses its leading
space) and a WordPiece one (spaces joined and cleaned up between tokens), each trained on the bundled
text. Token streams are real encodings and random ids (special tokens, broken characters).
"""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest
import torch
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers, trainers

from kvwarden import LLM, SamplingParams
from kvwarden.engine.detokenizer import IncrementalText
from kvwarden.models.bundled import corpus_text
from kvwarden.models.tokenizer import Tokenizer

SPECIAL = ["<s>", "</s>"]


def _trained(kind: str) -> Tokenizer:
    lines = corpus_text().splitlines(keepends=True)
    if kind == "metaspace":
        backend = Backend(models.BPE(unk_token="<unk>"))
        backend.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
        backend.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
        trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=["<unk>", *SPECIAL], show_progress=False)
    else:
        backend = Backend(models.WordPiece(unk_token="[UNK]"))
        backend.pre_tokenizer = pre_tokenizers.BertPreTokenizer()
        backend.decoder = decoders.WordPiece(cleanup=True)
        trainer = trainers.WordPieceTrainer(vocab_size=600, special_tokens=["[UNK]", *SPECIAL], show_progress=False)
    backend.train_from_iterator(lines, trainer=trainer, length=len(lines))
    return Tokenizer(backend, None, (backend.token_to_id("</s>"),))


@pytest.fixture(scope="module", params=["byte-level", "metaspace", "wordpiece"])
def tokenizer(request: pytest.FixtureRequest, llama_tiny: Path) -> Tokenizer:
    if request.param == "byte-level":
        return Tokenizer.from_dir(llama_tiny)
    return _trained(request.param)


def _streams(tok: Tokenizer) -> list[list[int]]:
    text = corpus_text()
    gen = torch.Generator().manual_seed(0)
    vocab = tok.vocab_size
    real = [tok.encode(text[i : i + 600], add_special_tokens=False) for i in (0, 5000, 20000)]
    noise = [torch.randint(0, vocab, (300,), generator=gen).tolist() for _ in range(3)]
    # Real text with special tokens and random ids spliced in.
    mixed = list(real[0][:100])
    for i, t in enumerate(torch.randint(0, vocab, (40,), generator=gen).tolist()):
        mixed += [t, *real[1][i * 3 : i * 3 + 3]]
    return [*real, *noise, mixed, [tok.eos_token_ids[0]] * 5 + real[2][:50]]


@pytest.mark.parametrize("skip", [True, False])
def test_every_step_equals_a_full_decode(tokenizer: Tokenizer, skip: bool) -> None:
    for ids in _streams(tokenizer):
        state = IncrementalText()
        for n in range(1, len(ids) + 1):
            got = state.update(tokenizer, ids[:n], skip)
            assert got == tokenizer.decode(ids[:n], skip_special_tokens=skip), (n, ids[:n][-5:])


def test_real_text_keeps_short_windows(tokenizer: Tokenizer) -> None:
    """The point of it: on real text the decoded window stays a few tokens long (no full decodes)."""
    assert tokenizer.local_decode
    ids = tokenizer.encode(corpus_text()[:4000], add_special_tokens=False)
    state = IncrementalText()
    longest = 0
    for n in range(1, len(ids) + 1):
        state.update(tokenizer, ids[:n], True)
        longest = max(longest, n - state.prefix_offset)
    assert not state.full
    assert longest <= 8, longest


def _byte_fallback() -> Tokenizer:
    """Llama-2's decoder pipeline over a vocabulary with the 256 byte tokens, as Llama-2 and Mistral ship."""
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"<0x{i:02X}>": 3 + i for i in range(256)}}
    vocab.update({"\u2581x": 259, "\u2581": 260, "y": 261})
    backend = Backend(models.BPE(vocab, [], unk_token="<unk>", byte_fallback=True))
    backend.decoder = decoders.Sequence(
        [decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)]
    )
    backend.add_special_tokens(["<s>", "</s>"])
    return Tokenizer(backend, None, (2,))


def test_byte_fallback_decoders_decode_in_full() -> None:
    """A run of byte tokens that turns invalid replaces its earlier valid bytes too (a space, here): a
    window would keep the space. Such tokenizers are not local, and every step is a full decode."""
    tok = _byte_fallback()
    assert not tok.local_decode
    space, bad = 3 + 0x20, 3 + 0x98
    gen = torch.Generator().manual_seed(1)
    streams = [[259, space, bad, 259], [259, space, 3 + 0xC3, 3 + 0xA9, 261]]
    streams += [torch.randint(0, 262, (200,), generator=gen).tolist() for _ in range(3)]
    for ids in streams:
        state = IncrementalText()
        for n in range(1, len(ids) + 1):
            assert state.update(tok, ids[:n], True) == tok.decode(ids[:n]), (n, ids[:n][-4:])


def test_engine_streams_the_final_text(llama_tiny: Path) -> None:
    """Through the engine: every streamed text is a prefix of the next, and the last one is the full decode."""
    llm = LLM(str(llama_tiny))
    try:
        engine = llm.engine
        params = SamplingParams(temperature=1.0, seed=3, max_tokens=200, ignore_eos=True)
        engine.add_request(list(range(30, 60)), params, request_id="r")
        texts = []
        while engine.has_unfinished_requests():
            texts += [o.text for o in engine.step() if o.request_id == "r"]
        assert len(texts) == 200
        for a, b in itertools.pairwise(texts):
            assert b.startswith(a.rstrip("\ufffd")), (a[-20:], b[-20:])
        out = llm.generate([list(range(30, 60))], params)[0]
        assert texts[-1] == out.text == engine.tokenizer.decode(out.token_ids)
    finally:
        llm.close()
