"""``kvwarden predict``: scheduling rules as code, and which runs mix cache provenance.

The simulator replays a sequence of requests through a scheduler rule and a
prefix cache (first writer wins, per KV block and, separately, per recurrent
state, as in vLLM's hybrid cache groups). It records for every KV block and
every saved state *which chunk computed it* - its provenance, e.g. ``tokens
0-3196 in one chunk`` - recursively including the provenance of the context
that chunk read. A run's provenance is that of everything its logits depend
on. Two runs with different provenance are predicted to differ, unless the
engine's numerics are canonical (kvwarden's), where nothing depends on chunking.

Requests are modelled by length and by how many leading tokens they share with
each other (a document prefix); the simulation covers prefill, which is where
the rules act.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

RULES = ("vllm-align", "vllm-align-fixed", "vllm", "kvwarden")


@dataclass(frozen=True)
class Chunk:
    start: int
    end: int
    prov: str  # provenance id of this computation

    def describe(self) -> str:
        return f"tokens {self.start}-{self.end} in one chunk"


@dataclass
class RunRecord:
    """What one request's run did and what it depended on."""

    name: str
    cached_tokens: int
    chunks: list[Chunk]
    provenance: str
    states_saved_at: list[int]
    kv_writers: dict[int, str] = field(default_factory=dict)  # block index -> who computed it
    state_writer: str = ""  # who computed the state restored at the hit boundary


def _h(*parts: object) -> str:
    return hashlib.sha256(repr(parts).encode()).hexdigest()[:16]


class Simulator:
    """One engine's prefix cache, fed requests one after another.

    Args:
        rule: ``vllm-align`` (vLLM's hybrid align mode), ``vllm-align-fixed``
            (its one-line fix), ``vllm`` (vLLM's plain chunked prefill, which it
            uses for dense models) or ``kvwarden``.
        block_size: KV block size B.
        num_spec_tokens: > 0 turns on the align rule's speculative pull-back.
        max_num_batched_tokens: the step budget (``None``: unlimited).
        hybrid: whether the model has recurrent layers (a hit then needs a state).
    """

    def __init__(
        self,
        rule: str,
        block_size: int,
        num_spec_tokens: int = 0,
        max_num_batched_tokens: int | None = None,
        hybrid: bool = True,
    ) -> None:
        if rule not in RULES:
            raise ValueError(f"--rule: unknown rule {rule!r}; expected one of {RULES}")
        if block_size < 1:
            raise ValueError("--block-size must be >= 1")
        if rule == "vllm" and hybrid:
            raise ValueError("--rule vllm models dense models; vLLM schedules hybrids with vllm-align (add --dense)")
        self.rule, self.b, self.spec = rule, block_size, num_spec_tokens
        self.budget = max_num_batched_tokens or 1 << 40
        self.hybrid = hybrid
        # block hash -> (provenance of each of its positions, writer description)
        self.kv: dict[str, tuple[tuple[str, ...], str]] = {}
        self.states: dict[str, tuple[str, str]] = {}  # block hash -> (provenance of the state at its end, writer)

    def _chunk_size(self, num_tokens: int, start: int) -> int:
        n = min(self.budget, num_tokens - start)
        if self.rule in ("kvwarden", "vllm"):
            return n
        b = self.b
        last = num_tokens - num_tokens % b
        if self.spec > 0:
            last = max(last - b, 0)
        end = start + n
        if end < last:
            n = n // b * b
        elif start < last < end:
            n = last - start
        if self.rule == "vllm-align-fixed":
            n = min(n, (start // b + 1) * b - start)
        return n

    def run(self, name: str, block_hashes: list[str], num_tokens: int) -> RunRecord:
        """Prefill a request whose full blocks have ``block_hashes``."""
        b = self.b
        # prefix hit: full blocks, at least one token left to compute, state at the boundary
        max_blocks = (num_tokens - 1) // b
        hit = 0
        while hit < max_blocks and block_hashes[hit] in self.kv:
            hit += 1
        if self.hybrid:
            while hit and block_hashes[hit - 1] not in self.states:
                hit -= 1
        state_writer = self.states[block_hashes[hit - 1]][1] if (self.hybrid and hit) else ""
        pos_prov: list[str] = [p for i in range(hit) for p in self.kv[block_hashes[i]][0]]
        writers = {i: self.kv[block_hashes[i]][1] for i in range(hit)}
        state = self.states[block_hashes[hit - 1]][0] if (self.hybrid and hit) else _h("empty-state")
        start = hit * b
        chunks: list[Chunk] = []
        saved: list[int] = []
        new_states: dict[int, str] = {}
        steps = 0
        while start < num_tokens:
            n = self._chunk_size(num_tokens, start)
            if n <= 0:  # the align rule can refuse a chunk smaller than a block: budget too small
                raise ValueError(f"rule {self.rule} cannot schedule from {start} with budget {self.budget}")
            end = start + n
            context = _h(tuple(pos_prov), state)
            prov = _h("chunk", start, end, context)
            chunk = Chunk(start, end, prov)
            chunks.append(chunk)
            pos_prov.extend([prov] * n)
            state = _h("state", end, prov)
            # where a state is saved: vLLM align mode only at a chunk end on a boundary;
            # kvwarden at every boundary the chunk crosses (from inside the chunk)
            if self.rule == "kvwarden":
                for boundary in range((start // b + 1) * b, end + 1, b):
                    new_states[boundary] = _h("state", boundary, prov)
            elif end % b == 0:
                new_states[end] = state
            start = end
            steps += 1
        # publish (first writer wins, separately for KV blocks and states)
        for i in range(num_tokens // b):
            if block_hashes[i] not in self.kv:
                writer = next(c for c in chunks if c.start <= i * b < c.end) if i >= hit else None
                desc = f"{name}: {writer.describe()}" if writer else ""
                self.kv[block_hashes[i]] = (tuple(pos_prov[i * b : (i + 1) * b]), desc)
                writers[i] = desc
            else:
                writers.setdefault(i, self.kv[block_hashes[i]][1])
        for boundary, prov in new_states.items():
            key = block_hashes[boundary // b - 1] if boundary // b - 1 < len(block_hashes) else None
            if key is not None and key not in self.states:
                writer = next(c for c in chunks if c.start < boundary <= c.end)
                self.states[key] = (prov, f"{name}: {writer.describe()}")
                saved.append(boundary)
        run_prov = _h(tuple(pos_prov), state)
        return RunRecord(name, hit * b, chunks, run_prov, sorted(saved), writers, state_writer)


def block_hashes(name: str, num_tokens: int, shared: int, block_size: int) -> list[str]:
    """Hashes of a request's full blocks: blocks inside the shared prefix are common."""
    return [f"doc:{i}" if (i + 1) * block_size <= shared else f"{name}:{i}" for i in range(num_tokens // block_size)]


@dataclass
class PairPrediction:
    """Request A once, then request B repeated, sharing their first ``shared`` tokens."""

    rule: str
    block_size: int
    num_spec_tokens: int
    max_num_batched_tokens: int | None
    a_len: int
    b_len: int
    shared: int
    repeats_stable: bool
    history_dependent: bool
    first_run_alike_clean: bool
    provenance_mixed: bool
    a_saved_state_at: dict[int, bool]
    b_cached_tokens: list[int]
    clean_cached_tokens: list[int]
    explanation: str

    def to_dict(self) -> dict[str, object]:
        d = dict(self.__dict__)
        d["a_saved_state_at"] = {str(k): v for k, v in self.a_saved_state_at.items()}
        return d


def predict_pair(
    rule: str,
    block_size: int,
    a_len: int,
    b_len: int,
    shared: int,
    num_spec_tokens: int = 0,
    max_num_batched_tokens: int | None = None,
    repeats: int = 3,
    hybrid: bool = True,
) -> PairPrediction:
    """Predict the clean and contaminated arms for one (A, B, shared) triple."""
    if not 0 <= shared <= min(a_len, b_len):
        raise ValueError(f"--pair: shared length {shared} must be <= both lengths ({a_len}, {b_len})")
    if min(a_len, b_len) < 1 or repeats < 2:
        raise ValueError("--pair: lengths must be >= 1 (and repeats >= 2)")

    def sim() -> Simulator:
        return Simulator(rule, block_size, num_spec_tokens, max_num_batched_tokens, hybrid)

    hb = block_hashes("B", b_len, shared, block_size)
    clean = sim()
    clean_runs = [clean.run(f"B run {i + 1}", hb, b_len) for i in range(repeats)]
    cont = sim()
    a_run = cont.run("A", block_hashes("A", a_len, shared, block_size), a_len)
    runs = [cont.run(f"B run {i + 1}", hb, b_len) for i in range(repeats)]
    canonical = rule == "kvwarden"
    provs = {r.provenance for r in runs}
    mixed = len(provs) > 1 or runs[0].provenance != clean_runs[0].provenance
    stable = canonical or len(provs) == 1
    history = (not canonical) and any(r.provenance != clean_runs[0].provenance for r in runs)
    boundaries = list(range(block_size, shared + 1, block_size))
    saved = {bd: bd in a_run.states_saved_at for bd in boundaries}
    return PairPrediction(
        rule=rule,
        block_size=block_size,
        num_spec_tokens=num_spec_tokens,
        max_num_batched_tokens=max_num_batched_tokens,
        a_len=a_len,
        b_len=b_len,
        shared=shared,
        repeats_stable=stable,
        history_dependent=history,
        first_run_alike_clean=canonical or runs[0].provenance == clean_runs[0].provenance,
        provenance_mixed=mixed,
        a_saved_state_at=saved,
        b_cached_tokens=[r.cached_tokens for r in runs],
        clean_cached_tokens=[r.cached_tokens for r in clean_runs],
        explanation=_explain(rule, a_run, runs, stable, history, canonical),
    )


def _explain(rule: str, a: RunRecord, runs: list[RunRecord], stable: bool, history: bool, canonical: bool) -> str:
    a_chunks = ", ".join(c.describe() for c in a.chunks)
    a_states = f"saved states at {a.states_saved_at}" if a.states_saved_at else "saved no state"
    head = f"A ran as {a_chunks} and {a_states}"
    if canonical:
        return f"{head}; kvwarden's numerics do not depend on chunking: every run is alike"
    mixed = next((r for r in runs if r.cached_tokens and r.provenance != runs[0].provenance), None)
    if mixed is not None:
        kv = "; ".join(sorted({w for w in mixed.kv_writers.values() if w}))
        return (
            f"{head}; {mixed.name} hits {mixed.cached_tokens} tokens: KV from [{kv}], state from "
            f"[{mixed.state_writer}] - mixed provenance, so it differs from {runs[0].name}"
        )
    if history:
        r = runs[0]
        return (
            f"{head}; B's runs hit {r.cached_tokens} tokens computed under A's chunking "
            f"({r.state_writer or 'no state'}), so B after A differs from B alone, but its repeats agree"
        )
    return f"{head}; every B run reads blocks and states computed by the same chunks as B alone"


def search_a_lengths(
    rule: str,
    block_size: int,
    b_len: int,
    shared: int,
    num_spec_tokens: int = 0,
    max_num_batched_tokens: int | None = None,
    a_range: tuple[int, int] | None = None,
    progress: Callable[[int, int], None] | None = None,
) -> list[tuple[int, int, bool, bool]]:
    """Intervals of A lengths with the same outcome: ``(from, to, repeats_stable, history_dependent)``;
    ``progress(done, total)`` is called after each A length."""
    lo, hi = a_range or (max(shared, 1), shared + 3 * block_size)
    out: list[tuple[int, int, bool, bool]] = []
    for a_len in range(lo, hi + 1):
        if progress is not None:
            progress(a_len - lo, hi - lo + 1)
        p = predict_pair(rule, block_size, a_len, b_len, min(shared, a_len), num_spec_tokens, max_num_batched_tokens)
        key = (p.repeats_stable, p.history_dependent)
        if out and (out[-1][2], out[-1][3]) == key:
            out[-1] = (out[-1][0], a_len, *key)
        else:
            out.append((a_len, a_len, *key))
    return out
