"""Structured outputs in the engine: every output matches its constraint, and the mask keeps invariance.

The grammar mask is a function of the request's tokens so far, applied element-wise, so the properties
(a)-(i) hold bitwise with a constraint on, speculation changes nothing (drafts are checked against the
mask), and a batch of differently constrained requests gives each what it gets alone. The mask itself
is checked against the grammar library's (llguidance's) own application of its bitmask.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

import pytest
import torch

from kvwarden import LLM, SamplingParams, StructuredOutputsParams
from kvwarden.bench.properties import PROPERTIES, check_properties, compare
from kvwarden.bench.workloads import random_tokens

BLOCK = 16
DATE = r"[0-9]{4}-[0-9]{2}-[0-9]{2}"
# A finite language (bounded strings and numbers, no free whitespace): a random-weight model always
# completes it within MAX_TOKENS, so every output can be checked whole.
INVOICE = {
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
MAX_TOKENS = 80
CONSTRAINTS = {
    "json": StructuredOutputsParams(json=INVOICE, any_whitespace=False),
    "regex": StructuredOutputsParams(regex=DATE),
    "choice": StructuredOutputsParams(choice=["paid", "unpaid", "2026. szeptember 3."]),
    "grammar": StructuredOutputsParams(grammar='root ::= "total: " [1-9] [0-9]? [0-9]? " Ft"'),  # GBNF
    "lark": StructuredOutputsParams(grammar='start: "total: " /[1-9][0-9]{0,2}/ " Ft"'),  # Lark
}


def valid(kind: str, text: str) -> bool:
    if kind == "json":
        value = json.loads(text)
        return (
            list(value) == ["date", "amount", "currency", "note"]  # the schema's order
            and re.fullmatch(DATE, value["date"]) is not None
            and isinstance(value["amount"], int)
            and 0 <= value["amount"] <= 99999
            and value["currency"] in ("EUR", "HUF", "USD")
            and len(value["note"]) <= 6
        )
    if kind == "regex":
        return re.fullmatch(DATE, text) is not None
    if kind == "choice":
        return text in ("paid", "unpaid", "2026. szeptember 3.")
    return re.fullmatch(r"total: [1-9][0-9]{0,2} Ft", text) is not None  # grammar, lark


def params(kind: str, seeded: bool, seed: int = 0) -> SamplingParams:
    sampling = {"temperature": 0.9, "top_p": 0.95, "seed": seed} if seeded else {"temperature": 0.0}
    return SamplingParams(**sampling, max_tokens=MAX_TOKENS, logprobs=20, structured_outputs=CONSTRAINTS[kind])


@pytest.fixture(scope="module")
def llm(llama_tiny: Path) -> LLM:
    return LLM(str(llama_tiny), block_size=BLOCK)


@pytest.mark.parametrize("seeded", [False, True])
@pytest.mark.parametrize("kind", sorted(CONSTRAINTS))
def test_every_output_matches_its_constraint(llm: LLM, kind: str, seeded: bool) -> None:
    rng = random.Random(7)
    prompts = [random_tokens(rng, rng.randint(3, 40), 1000) for _ in range(6)]
    outs = llm.generate(prompts, [params(kind, seeded, i) for i in range(6)], use_tqdm=False)
    for out in outs:
        assert out.finish_reason == "stop" and valid(kind, out.text), (kind, out.text, out.finish_reason)
        # logprobs stay the model's raw distribution: its top list may hold tokens the grammar forbids
        assert all(len(top) == 20 for top in out.logprobs or [])
    if seeded:
        assert len({o.text for o in outs}) > 1, "seeded draws from the masked distribution vary"


def test_the_mask_is_the_grammar_librarys_bitmask(llm: LLM) -> None:
    import llguidance
    from llguidance.numpy import allocate_token_bitmask, apply_token_bitmask_inplace, fill_next_token_bitmask

    grammars = llm.engine.grammars
    vocab = grammars.vocab_size
    gen = torch.Generator().manual_seed(0)
    text_ids = llm.tokenizer.encode('{"date":"2026-09-03","amount":12,"currency":"HUF","note":"ok"}', False)
    state = grammars.state(CONSTRAINTS["json"])
    matcher = grammars.compile(CONSTRAINTS["json"]).deep_copy()
    assert isinstance(matcher, llguidance.LLMatcher)
    bitmask = allocate_token_bitmask(1, vocab)
    for token in [*text_ids, *llm.tokenizer.eos_token_ids[:1]]:
        logits = torch.randn(vocab, generator=gen)
        ours = logits.masked_fill(~state.masks([], "cpu")[0], float("-inf"))
        theirs = logits.numpy().copy().reshape(1, -1)
        fill_next_token_bitmask(matcher, bitmask, 0)
        apply_token_bitmask_inplace(theirs, bitmask)
        assert torch.equal(ours, torch.from_numpy(theirs[0]))
        assert 0 < int(torch.isfinite(ours).sum()) < vocab
        state.accept(token)
        assert matcher.consume_token(token)
    assert matcher.is_stopped()


def test_draft_masks_follow_the_drafts_and_leave_the_state(llm: LLM) -> None:
    grammars = llm.engine.grammars
    prefix = llm.tokenizer.encode('{"date":"20', False)
    drafts = llm.tokenizer.encode('26-09-03","amount', False)
    walked = grammars.state(CONSTRAINTS["json"])
    state = grammars.state(CONSTRAINTS["json"])
    for token in prefix:
        walked.accept(token)
        state.accept(token)
    masks = state.masks(drafts, "cpu")
    assert masks.shape[0] == len(drafts) + 1
    for i, token in enumerate(drafts):
        assert torch.equal(masks[i], walked.masks([], "cpu")[0])
        walked.accept(token)
    assert torch.equal(masks[-1], walked.masks([], "cpu")[0])
    assert torch.equal(state.masks([], "cpu")[0], masks[0]), "masks() rolls the matcher back"
    # a draft the grammar refuses ends the rows: verify cannot go past it
    refused = llm.tokenizer.encode("x", False)
    assert state.masks([drafts[0], refused[0], drafts[1]], "cpu").shape[0] == 2
    with pytest.raises(RuntimeError, match="grammar refuses"):
        state.accept(refused[0])


@pytest.mark.parametrize(("kind", "seeded"), [("json", False), ("json", True), ("regex", True), ("grammar", False)])
def test_invariance_properties_hold_with_a_constraint(llama_tiny: Path, kind: str, seeded: bool) -> None:
    rng = random.Random(3)
    prompt = random_tokens(rng, 2 * BLOCK + 5, 1000)
    partners = [random_tokens(rng, rng.randint(5, 40), 1000) for _ in range(3)]

    def make(**overrides: object) -> LLM:
        return LLM(str(llama_tiny), **{"block_size": BLOCK, **overrides})  # type: ignore[arg-type]

    report = check_properties(make, prompt, params(kind, seeded, 5), BLOCK, partners, PROPERTIES)
    assert report.all_identical, report.failures()


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_speculation_with_a_constraint_equals_speculation_off(llama_tiny: Path, method: str) -> None:
    rng = random.Random(5)
    prompts = [random_tokens(rng, rng.randint(8, 40), 1000) for _ in CONSTRAINTS]
    spec: dict = {"method": method, "num_speculative_tokens": 3}
    if method == "draft":
        spec["model"] = str(llama_tiny)  # self-draft: it proposes the unconstrained choice, often forbidden
    for seeded in (False, True):
        batch = [params(kind, seeded, i) for i, kind in enumerate(sorted(CONSTRAINTS))]
        ref = LLM(str(llama_tiny), block_size=BLOCK).generate(prompts, batch, use_tqdm=False)
        outs = LLM(str(llama_tiny), block_size=BLOCK, speculative_config=spec).generate(prompts, batch, use_tqdm=False)
        for r, o in zip(ref, outs, strict=True):
            assert compare(r, o).identical, (method, seeded, r.text, o.text)
        if method == "draft":
            stats = [o.spec_stats for o in outs if o.spec_stats is not None]
            proposed = sum(s.num_draft_tokens for s in stats)
            accepted = sum(s.num_accepted_tokens for s in stats)
            assert 0 < accepted < proposed, "drafts were proposed, some accepted, some refused"


def test_a_batch_of_constraints_gives_each_what_it_gets_alone(llama_tiny: Path) -> None:
    rng = random.Random(9)
    kinds = [*sorted(CONSTRAINTS), None]
    prompts = [random_tokens(rng, rng.randint(5, 50), 1000) for _ in kinds]
    plain = SamplingParams(temperature=0.0, max_tokens=12, logprobs=20)
    batch = [params(k, seeded=i % 2 == 1, seed=i) if k else plain for i, k in enumerate(kinds)]
    together = LLM(str(llama_tiny), block_size=BLOCK).generate(prompts, batch, use_tqdm=False)
    for prompt, p, out in zip(prompts, batch, together, strict=True):
        alone = LLM(str(llama_tiny), block_size=BLOCK).generate([prompt], p, use_tqdm=False)[0]
        assert compare(alone, out).identical


def test_bad_constraints_are_refused_naming_the_field_and_compiled_once(llm: LLM) -> None:
    for so, field in (
        (StructuredOutputsParams(regex="[0-"), "structured_outputs.regex"),
        (StructuredOutputsParams(json={"type": "strin"}), "structured_outputs.json"),
        (StructuredOutputsParams(grammar="start: undefined_rule"), "structured_outputs.grammar"),
        (StructuredOutputsParams(grammar="root ::= [0-"), "structured_outputs.grammar"),
    ):
        with pytest.raises(ValueError, match=re.escape(field)):
            llm.generate([[5, 6, 7]], SamplingParams(max_tokens=4, structured_outputs=so), use_tqdm=False)
    assert not llm.engine.has_unfinished_requests() and llm.engine.pool.num_free_blocks == llm.engine.num_blocks
    for kwargs, message in (
        ({}, "exactly one"),
        ({"regex": "a", "choice": ["a"]}, "regex and choice"),
        ({"json": "{not json"}, "not valid JSON"),
        ({"choice": []}, "non-empty list"),
    ):
        with pytest.raises(ValueError, match=message):
            StructuredOutputsParams(**kwargs)
    for extra in ({"ignore_eos": True}, {"min_tokens": 2}):
        with pytest.raises(ValueError, match=next(iter(extra))):
            SamplingParams(max_tokens=8, structured_outputs=CONSTRAINTS["regex"], **extra)
    grammars = llm.engine.grammars
    grammars.compile(CONSTRAINTS["json"])
    hits, compiled = grammars.hits, grammars.compiled
    same = StructuredOutputsParams(json=json.dumps(INVOICE), any_whitespace=False)  # the schema as text
    llm.generate([[5, 6, 7], [8, 9]], SamplingParams(max_tokens=MAX_TOKENS, structured_outputs=same), use_tqdm=False)
    assert grammars.compiled == compiled and grammars.hits >= hits + 2


def test_a_grammar_may_ask_for_a_special_token_mid_way(llm: LLM) -> None:
    """Special tokens other than EOS are cleared only where the grammar may end (llguidance can allow the
    tokenizer's own end-of-text there); a grammar that needs one mid-way gets it."""
    special = next(i for i in range(llm.tokenizer.vocab_size) if i not in llm.tokenizer.eos_token_ids and
                   llm.tokenizer.backend.id_to_token(i) in {t.content for t in
                   llm.tokenizer.backend.get_added_tokens_decoder().values() if t.special})  # fmt: skip
    so = StructuredOutputsParams(grammar=f'start: "a" <[{special}]> "b"')
    for params in (
        SamplingParams(temperature=0.0, max_tokens=8),
        SamplingParams(temperature=1.0, seed=3, max_tokens=8),
    ):
        out = llm.generate([[5, 6, 7]], SamplingParams(**{**params.__dict__, "structured_outputs": so}))[0]
        assert special in out.token_ids and out.finish_reason == "stop" and out.error is None, out


def test_a_grammar_that_cannot_go_on_ends_its_request_only(llm: LLM) -> None:
    """A real matcher left with no allowed token (here: its only continuation, EOS, forbidden) ends that
    request with finish_reason abort and an error; the request beside it in the batch is unaffected."""
    from kvwarden.engine.structured.state import GrammarState

    engine = llm.engine
    so = StructuredOutputsParams(choice=["a"])
    free = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    alone = llm.generate([[9, 10, 11]], free)[0]
    engine.add_request([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=6, structured_outputs=so), "stuck")
    engine.add_request([9, 10, 11], free, "beside")
    eos = tuple(llm.tokenizer.eos_token_ids)
    matcher = engine.grammars.compile(so).deep_copy()
    engine.requests["stuck"].grammar = GrammarState(matcher, engine.grammars.vocab_size, eos, forbidden=eos)
    done = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out
    assert done["stuck"].finish_reason == "abort" and "allows no token" in done["stuck"].error
    assert done["stuck"].text == "a"  # what the grammar allowed was emitted; then it could not go on
    assert done["beside"].token_ids == alone.token_ids and done["beside"].error is None
    assert engine.pool.num_free_blocks == engine.num_blocks  # every block back in the pool


def test_an_accepted_draft_that_ends_the_grammar_counts_as_accepted(llm: LLM) -> None:
    """verify stops after an EOS draft the mask row allows: every emitted token was a draft."""
    from kvwarden.engine.spec.verify import verify

    engine = llm.engine
    so = StructuredOutputsParams(choice=["a"])
    state = engine.grammars.state(so)
    a = llm.tokenizer.encode("a", False)
    eos = llm.tokenizer.eos_token_ids[0]
    drafts = [*a, eos]
    masks = state.masks(drafts, "cpu")
    assert masks.shape[0] == len(drafts)  # no row after the end
    rows = torch.zeros(len(drafts) + 1, engine.grammars.vocab_size)
    rows[torch.arange(len(drafts)), torch.tensor(drafts)] = 1.0  # the target agrees with every draft
    params = SamplingParams(temperature=0.0, max_tokens=4)
    samples, accepted = verify(rows, drafts, params, 0, 3, engine.row_math, "match", None, masks)
    assert [s.token_id for s in samples] == drafts and accepted == len(drafts)
