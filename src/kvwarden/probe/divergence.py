"""``kvwarden trace-divergence``: run scenarios on one model, find the first differing activation.

A scenario is an engine configuration plus prompts run one after another on
the same engine (so earlier requests can warm the cache). :func:`run_scenario`
traces every request; :func:`contamination_study` runs the contamination scenario of docs/production-story.md §1 and
answers two questions:

1. *Where* do B's first and second runs part ways? (first differing operation
   and position among the positions both runs computed, and how the
   difference grows layer by layer)
2. *Who* wrote what B's second run read? (A's prefill of the shared tokens
   against B's own prefill of the same tokens: the first operation whose result
   depends on the chunk it ran in)
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvwarden.engine.outputs import RequestOutput
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.probe.tracer import Divergence, Tracer, compare


@dataclass
class ScenarioRun:
    outputs: list[RequestOutput]
    tracer: Tracer
    request_ids: list[str]
    chunks: dict[str, list[tuple[int, int]]]  # request -> [(start, end)] chunks it was computed in


def run_scenario(
    model: str | Path, engine_kwargs: dict[str, Any], prompts: list[list[int]], max_tokens: int
) -> ScenarioRun:
    """Run ``prompts`` one after another on one engine, tracing all of them."""
    from kvwarden.llm import LLM

    llm = LLM(str(model), **engine_kwargs)
    tracer = Tracer()
    llm.engine.runner.tracer = tracer
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, logprobs=20, ignore_eos=True)
    outputs, ids = [], []
    chunks: dict[str, list[tuple[int, int]]] = {}
    engine = llm.engine
    for i, prompt in enumerate(prompts):
        rid = f"req{i}"
        ids.append(rid)
        engine.add_request(prompt, params, request_id=rid)
        done = None
        while done is None:
            for out in engine.step():
                if out.request_id == rid and out.finished:
                    done = out
            for r, start, end in engine.last_scheduled:
                chunks.setdefault(r, []).append((start, end))
        outputs.append(done)
    return ScenarioRun(outputs=outputs, tracer=tracer, request_ids=ids, chunks=chunks)


def divergence(
    run_a: ScenarioRun, rid_a: str, run_b: ScenarioRun, rid_b: str, positions: set[int] | None = None
) -> Divergence:
    order = run_a.tracer.order + [op for op in run_b.tracer.order if op not in set(run_a.tracer.order)]
    return compare(run_a.tracer.traces.get(rid_a, {}), run_b.tracer.traces.get(rid_b, {}), order, positions)


def _prefill_chunks(chunks: list[tuple[int, int]], prompt_len: int) -> list[tuple[int, int]]:
    return [(s, e) for s, e in chunks if s < prompt_len]


def spec_config(num_speculative_tokens: int) -> dict[str, Any] | None:
    """Speculation on (n-gram, any model) when the legacy rule should pull back; ``None`` for 0."""
    if num_speculative_tokens <= 0:
        return None
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens}


def contamination_study(
    model: str | Path,
    block_size: int = 16,
    a_len: int = 28,
    b_len: int = 44,
    shared: int = 24,
    num_speculative_tokens: int = 1,
    chunking: str = "legacy-align",
    numerics: str = "shape-dependent",
    max_tokens: int = 4,
    seed: int = 0,
) -> dict[str, Any]:
    """The contamination scenario (docs/production-story.md §1) at a chosen scale.

    A once, B twice, on one engine; every activation traced.
    """
    if not 0 < shared <= min(a_len, b_len):
        raise ValueError(f"--shared must be in (0, min(a_len, b_len)], got {shared}")
    rng = random.Random(seed)
    doc = [rng.randrange(3, 1000) for _ in range(shared)]
    a = doc + [rng.randrange(3, 1000) for _ in range(a_len - shared)]
    b = doc + [rng.randrange(3, 1000) for _ in range(b_len - shared)]
    kw = {
        "block_size": block_size,
        "chunking": chunking,
        "numerics": numerics,
        "speculative_config": spec_config(num_speculative_tokens),
        "max_num_batched_tokens": max(a_len, b_len) + 16,
    }
    run = run_scenario(model, kw, [a, b, b], max_tokens)
    out_a, b1, b2 = run.outputs
    prompt_positions = set(range(b_len))
    where = divergence(run, "req1", run, "req2")
    writer = divergence(run, "req0", run, "req1", positions=set(range(shared)))
    return {
        "scenario": {
            **kw,
            "num_speculative_tokens": num_speculative_tokens,
            "a_len": a_len,
            "b_len": b_len,
            "shared": shared,
            "max_tokens": max_tokens,
        },
        "cached_tokens": {
            "A": out_a.num_cached_tokens,
            "B run 1": b1.num_cached_tokens,
            "B run 2": b2.num_cached_tokens,
        },
        "chunks": {
            "A": _prefill_chunks(run.chunks.get("req0", []), a_len),
            "B run 1": _prefill_chunks(run.chunks.get("req1", []), b_len),
            "B run 2": _prefill_chunks(run.chunks.get("req2", []), b_len),
        },
        "b_runs_identical": b1.logprobs == b2.logprobs,
        "b1_vs_b2": where.to_dict(),
        "b1_vs_b2_prompt_only": divergence(run, "req1", run, "req2", positions=prompt_positions).first_op,
        "writer_a_vs_b1_on_shared_tokens": writer.to_dict(),
    }


def describe(report: dict[str, Any]) -> list[str]:
    """Human-readable lines for a contamination study."""
    lines = []
    sc = report["scenario"]
    lines.append(
        f"scenario: block {sc['block_size']}, A {sc['a_len']} tokens, B {sc['b_len']} tokens sharing {sc['shared']}; "
        f"chunking {sc['chunking']}, numerics {sc['numerics']}, speculative tokens {sc['num_speculative_tokens']}"
    )
    for who, chunks in report["chunks"].items():
        lines.append(f"  {who}: prefill chunks {chunks}, cached tokens {report['cached_tokens'][who]}")
    w = report["b1_vs_b2"]
    if w["identical"]:
        lines.append("B run 1 and B run 2: bitwise identical at every traced activation")
    else:
        lines.append(
            f"B run 1 vs B run 2: first difference at {w['first_op']} position {w['first_position']} "
            f"(max |delta| {w['max_abs_delta']:.3g}); {w['differing_ops']} operations differ"
        )
        growth = ", ".join(f"L{x['layer']}: {x['max_abs_delta']:.3g}" for x in w["per_layer"])
        lines.append(f"  layer outputs, max |delta|: {growth}")
    r = report["writer_a_vs_b1_on_shared_tokens"]
    if r["identical"]:
        lines.append("A's and B's prefill of the shared tokens: identical")
    else:
        lines.append(
            f"A's prefill vs B's own prefill of the same {sc['shared']} tokens: first difference at "
            f"{r['first_op']} position {r['first_position']} (max |delta| {r['max_abs_delta']:.3g})"
        )
    return lines
