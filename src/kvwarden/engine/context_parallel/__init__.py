"""Context parallelism on one host: a long step's rows split across ranks, answers bitwise as on one rank.

* :mod:`.shares` - the contiguous split of a step's rows (each share an ordinary chunk).
* :mod:`.group` - the ranks' gloo process group and TCP store on loopback, byte-row collectives.
* :mod:`.exchange` - K/V rows between the ranks' caches: per layer in a split step, after a rank-0 step.
* :mod:`.layer_split` - each rank storing every n-th layer; the view buffers, the owners' prefetched broadcasts.
* :mod:`.step` - one step on this rank: its share through the model, caches whole or split.
* :mod:`.messages` - what rank 0 posts to the store, as JSON.
* :mod:`.workers` - rank 0's worker processes (also tensor parallelism's): started, watched, told, stopped.
* :mod:`.coordinator` - rank 0: starts the workers, splits eligible steps, syncs the others.
* :mod:`.worker` - ranks 1..: the same model and cache, running rank 0's messages.
"""

from kvwarden.engine.context_parallel.coordinator import ContextParallel, unsupported

__all__ = ["ContextParallel", "unsupported"]
