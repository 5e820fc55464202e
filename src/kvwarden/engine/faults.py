"""Faults injected on purpose, for tests only: ``kvwarden serve --inject-fault NAME=VALUE``.

Nothing is injected unless the flag names it; a server with faults says so in
``/health`` and at start-up, so nobody mistakes it for a healthy one. The
faults re-create what production engines do when a cache goes wrong, so the
guard (``kvwarden guard``) and the probe can be shown to catch it:

* ``kv-corruption=RATE``: for that share of requests, the KV blocks the
  request holds alone are overwritten with noise right after its prefill (the
  first token is still clean; every later one attends to garbage), and those
  blocks leave the prefix cache so the damage stays with the request.
* ``transfer-delay=MS`` (prefill role): each KV transfer posts its slices
  spread over MS milliseconds, so aborts arrive before, during and after the
  writes (the disaggregated abort race, with ``--unsafe-pd-abort`` on decode).
* ``repetition=RATE``: for that share of requests, decoding is forced into a
  loop (each token repeats the one ``period`` positions back), as a sampler bug
  or a corrupted recurrent state would.

Which requests are hit is drawn from ``fault-seed`` in arrival order, so a run
is reproducible.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from kvwarden.cache.block_pool import Block
    from kvwarden.engine.request import Request

# name -> (type, what it does)
KNOWN: dict[str, tuple[type, str]] = {
    "engine-crash-after-steps": (int, "the engine thread raises after this many steps (tests the failure path)"),
    "kv-corruption": (float, "share of requests whose KV blocks are overwritten with noise after prefill"),
    "repetition": (float, "share of requests forced into a repeating loop"),
    "fault-seed": (int, "seed of the draw that picks the requests hit (default 0)"),
    "host-load-delay": (float, "milliseconds each host-tier load waits before it copies (tests the wait before use)"),
    "transfer-delay": (float, "prefill role: milliseconds each KV transfer is spread over (aborts land mid-transfer)"),
    "layer-split-delay": (float, "--layer-split: milliseconds each layer's broadcast starts late (tests the wait)"),
}
_RATES = ("kv_corruption", "repetition")

# The loop the repetition fault forces: token t repeats token t - PERIOD, from the first generated token on.
REPETITION_PERIOD = 4
# Noise replacing corrupted K/V, in units of the block's own standard deviation: the same order of
# magnitude as real activations, but carrying no information (measured on llama-tiny with n-gram
# speculation: accept length 2.0 -> 1.06).
NOISE_SCALE = 4.0


@dataclass(frozen=True)
class Faults:
    """Injected faults (all off by default)."""

    engine_crash_after_steps: int | None = None
    kv_corruption: float | None = None
    repetition: float | None = None
    fault_seed: int | None = None
    host_load_delay: float | None = None
    transfer_delay: float | None = None
    layer_split_delay: float | None = None

    def __post_init__(self) -> None:
        for name in _RATES:
            rate = getattr(self, name)
            if rate is not None and not 0.0 <= rate <= 1.0:
                flag = name.replace("_", "-")
                raise ValueError(f"--inject-fault {flag}={rate}: the rate must be in [0, 1]")

    @property
    def any(self) -> bool:
        return any(v is not None for v in asdict(self).values())

    @property
    def touches_requests(self) -> bool:
        """Whether an engine-side injector is needed (a rate fault is on)."""
        return any(getattr(self, name) for name in _RATES)

    def describe(self) -> dict[str, object]:
        return {k.replace("_", "-"): v for k, v in asdict(self).items() if v is not None}

    @classmethod
    def parse(cls, specs: list[str]) -> Faults:
        """From ``NAME=VALUE`` strings; a ``ValueError`` naming ``--inject-fault`` for anything else."""
        values: dict[str, object] = {}
        for spec in specs:
            name, sep, raw = spec.partition("=")
            if not sep or name not in KNOWN:
                known = ", ".join(f"{k}={KNOWN[k][0].__name__.upper()}" for k in KNOWN)
                raise ValueError(f"--inject-fault {spec!r}: expected NAME=VALUE with NAME one of: {known}")
            kind, _ = KNOWN[name]
            try:
                values[name.replace("-", "_")] = kind(raw)
            except ValueError as exc:
                raise ValueError(f"--inject-fault {spec!r}: {raw!r} is not a valid {kind.__name__}") from exc
        return cls(**values)  # type: ignore[arg-type]


class FaultInjector:
    """Applies :class:`Faults` inside an :class:`~kvwarden.engine.llm_engine.LLMEngine` (engine thread only).

    NOTE: this is the one place allowed to break the engine's invariance: it
    exists to show that the tools catch broken engines. It is attached only by
    ``kvwarden serve --inject-fault``.
    """

    def __init__(self, faults: Faults) -> None:
        self.faults = faults
        self._draw = random.Random(faults.fault_seed or 0)
        self._corrupt: set[str] = set()
        self._loop: set[str] = set()
        self._serial = 0
        self.num_corrupted = 0
        self.num_looped = 0

    def on_add(self, request_id: str) -> None:
        """Decide, in arrival order, which faults hit this request."""
        # Two draws per request whatever the rates, so one fault's rate does not shift the other's picks.
        corrupt, loop = self._draw.random(), self._draw.random()
        if corrupt < (self.faults.kv_corruption or 0.0):
            self._corrupt.add(request_id)
        if loop < (self.faults.repetition or 0.0):
            self._loop.add(request_id)

    def release(self, request_id: str) -> None:
        self._corrupt.discard(request_id)
        self._loop.discard(request_id)

    def after_prefill(
        self, req: Request, blocks: list[Block], kv_caches: Sequence[tuple[torch.Tensor, torch.Tensor]], block_size: int
    ) -> list[Block]:
        """Overwrite the request's private KV blocks with noise (once, before its first sample).

        Returns the blocks overwritten: the caller drops them from the prefix cache, so
        nobody else can hit the garbage.
        """
        if req.request_id not in self._corrupt or req.output_token_ids:
            return []
        self._corrupt.discard(req.request_id)
        mine = [b for b in blocks if b.ref_cnt == 1]  # blocks shared with running requests stay clean
        gen = torch.Generator().manual_seed((self.faults.fault_seed or 0) * 1_000_003 + self._serial)
        self._serial += 1
        for k_cache, v_cache in kv_caches:
            dim = k_cache.shape[-1]  # the CPU layout's V carries a ones column after dim: keep it
            for block in mine:
                rows = slice(block.block_id * block_size, (block.block_id + 1) * block_size)
                for cache in (k_cache[rows], v_cache[rows, :, :dim]):
                    scale = float(cache.float().std()) * NOISE_SCALE or 1.0
                    noise = torch.randn(cache.shape, generator=gen) * scale
                    cache.copy_(noise.to(cache.dtype))
        self.num_corrupted += 1
        return mine

    def bias(self, req: Request, rows: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        """Rows forcing the loop: row ``i`` chooses the token ``REPETITION_PERIOD`` back from its position."""
        if req.request_id not in self._loop:
            return rows
        if not req.output_token_ids:
            self.num_looped += 1
        history = req.all_token_ids + drafts
        out = rows.clone()
        for i in range(rows.shape[0]):
            context = history[: req.num_tokens + i]
            if len(context) >= REPETITION_PERIOD:
                out[i, context[-REPETITION_PERIOD]] = out[i].max() + 50.0
        return out
