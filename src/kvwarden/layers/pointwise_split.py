"""Where torch's element-wise CPU kernels leave the SIMD path, and the call length that avoids it.

NOTE(invariance): an element-wise kernel's scalar remainder loop gives other bits
than its SIMD loop (last bit). ``CanonicalOps.pointwise`` pads every call to
:func:`pointwise_length`, so no element of any call lands in a remainder.
"""

from __future__ import annotations

from kvwarden.intmath import cdiv, round_up

# torch's element-wise CPU kernels (TensorIterator) split a contiguous tensor of N elements into
# min(threads, ceil(N / GRAIN)) ranges of ceil(N / parts) elements (the last one shorter); each range
# runs the SIMD loop on blocks of two vectors and a scalar loop on the remainder, whose results
# differ from the SIMD ones in the last bit. SIMD_BLOCK bounds two vectors of any dtype (AVX-512
# bfloat16: 64 elements). (exp may take MKL's VML path instead, whose split leaves no scalar
# tail; the padding does no harm there.)
GRAIN = 32768
SIMD_BLOCK = 256


def pointwise_length(n: int, threads: int) -> int:
    """The padded length of an element-wise call over ``n`` elements: the least multiple of
    :data:`SIMD_BLOCK` at which every thread's range is a whole number of blocks (no scalar
    remainder anywhere). ``tests/test_numerics.py`` pins the split rule for 1 to 4 threads."""
    padded = max(round_up(n, SIMD_BLOCK), SIMD_BLOCK)
    while True:
        parts = max(1, min(threads, cdiv(padded, GRAIN)))
        if padded % (parts * SIMD_BLOCK) == 0:
            return padded
        padded += SIMD_BLOCK
