"""Canonical Triton kernels: the GPU side of ``numerics="canonical"``.

One file per kernel family, each opening with its invariance argument: why a
row's (or a position's) result cannot depend on what else is in the launch or
on how the scheduler cut the work. The arguments are about the kernels'
structure (fixed tiles chosen from the weight's shape, one program per row,
reduction orders fixed by absolute positions), never about a library happening
to behave.

Conventions that hold in every file:

* NOTE(invariance): integer arguments that vary with the batch (row counts,
  positions, lengths) are listed in ``do_not_specialize``, so a 1-row decode
  and a 4000-row prefill run the *same* compiled kernel (Triton would otherwise
  compile a separate variant for a value of 1 or a multiple of 16).
* Block sizes and launch options are chosen from model dimensions only
  (hidden size, head size, vocabulary, weight shape), never from the batch.
* Everything is testable on a CPU under ``TRITON_INTERPRET=1`` (tiny shapes,
  float32: the interpreter's bfloat16 ``tl.dot`` is wrong in Triton 3.9, so
  bfloat16 is checked on the GPU by ``scripts/gpu_check.sh``).
"""
