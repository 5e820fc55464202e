"""What speculative decoding sees of the engine it drafts for: a narrow interface, not the engine class.

The speculator and the proposers read the target's scheduler, caches, runner
and model through :class:`SpecTarget`; a draft model's engine is built by the
:data:`EngineFactory` the target hands in (the target's own class). So this
package imports nothing of :mod:`kvwarden.engine.llm_engine`, and the engine
depends on speculation, not speculation on the engine.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from kvwarden.cache.hybrid_manager import HybridCacheManager
from kvwarden.cache.kv_cache_manager import KVCacheManager
from kvwarden.cache.state_pool import StatePool
from kvwarden.config import EngineConfig
from kvwarden.engine.model_runner import ModelRunner
from kvwarden.engine.row_math import RowMath
from kvwarden.engine.scheduler import Scheduler
from kvwarden.layers.numerics import Ops
from kvwarden.models.config import ModelConfig
from kvwarden.models.loader import LoadedModel
from kvwarden.models.tokenizer import Tokenizer


class SpecTarget(Protocol):
    """The engine as speculation uses it (a draft model's engine is one too)."""

    config: EngineConfig
    scheduler: Scheduler
    states: StatePool | None
    kv: KVCacheManager | HybridCacheManager
    runner: ModelRunner
    loaded: LoadedModel
    model_config: ModelConfig
    tokenizer: Tokenizer
    ops: Ops
    row_math: RowMath
    num_blocks: int
    max_model_len: int


# Builds an engine for a config (the draft model's): the target hands in its own class.
EngineFactory = Callable[[EngineConfig], SpecTarget]
