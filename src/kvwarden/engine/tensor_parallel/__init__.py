"""Tensor and expert parallelism on one host, its answer independent of the number of ranks.

* :mod:`.comm` - the all-gather of column blocks the sharded model calls, over the ranks' gloo group.
* :mod:`.coordinator` - rank 0: starts the workers, runs every step on all ranks, keeps the sampler.
* :mod:`.worker` - ranks 1..: the same checkpoint's slices, running rank 0's steps.

What each rank holds and why the answer does not move with the rank count: ``models/tensor_shard.py``.
"""

from kvwarden.engine.tensor_parallel.coordinator import TensorParallel

__all__ = ["TensorParallel"]
