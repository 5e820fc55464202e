"""Numerical tolerances derived from the dtype, the reduction length and the magnitude - never from the
error one machine happened to show.

Two programs that compute the same real number with floating-point sums in different orders (another BLAS
blocking, another vector width, another CPU vendor, transformers against kvwarden) differ by rounding
alone. How much is known in advance:

* **One reduction** (:func:`reorder_bound`). A sum or dot product of ``n`` terms evaluated in *any* order
  satisfies ``|fl(s) - s| <= gamma_n * sum|terms|`` with ``gamma_n = n u / (1 - n u)`` and ``u`` the unit
  roundoff of the dtype (Higham, *Accuracy and Stability of Numerical Algorithms*, 2nd ed., eq. 3.4;
  products rounded once, fused multiply-adds only tighten it). Two evaluations then differ by at most
  twice that. This is a worst case, not an estimate: a kernel test that compares one op against a
  reference in another order uses it, with ``sum|terms|`` computed by running the reference on absolute
  values (:func:`abs_dot`).
* **A whole forward pass** (:func:`model_tolerance`). A logit is reached through a chain of ``depth``
  reductions (per layer: the norm, the projections, the attention's scores and weighted values, the MLP's
  two GEMMs; then the final norm and the LM head; a recurrent layer's state one update per position before
  it), each of at most ``length`` terms. Rounding errors of
  distinct operations behave as independent, zero-mean variables (Higham and Mary, *A New Approach to
  Probabilistic Rounding Error Analysis*, SIAM J. Sci. Comput. 41(5), 2019): their total relative effect
  is at most ``LAMBDA * u * sqrt(length * depth)`` except with probability below ``2 exp(-LAMBDA**2 / 2)``.
  The residual stream and its RMSNorms carry a relative error through a layer without amplifying it, so
  the absolute bound on a logit is that times the logits' magnitude. A log-softmax value moves by at most
  twice its logits' largest move (the log-sum-exp is a weighted mean of them).

A wrong model (a missed bias, another epsilon, a transposed rotary half) moves logits by 1e-2 and more,
above every bound these give for the models the tests build; a reordered sum stays below them on any
CPU.
"""

from __future__ import annotations

import math

import torch

# Coverage of the probabilistic bound: exceeded with probability below 2 exp(-32) ~ 2.5e-14 per value.
LAMBDA = 8.0
# Reductions in series per layer: input norm, QKV projection, attention scores, weighted values, output
# projection, post-attention norm, gate/up projection, down projection (a hybrid's recurrent mixer or a
# router's GEMM and the expert sum stand in the same places).
REDUCTIONS_PER_LAYER = 8


def unit_roundoff(dtype: torch.dtype) -> float:
    """``u``: half the gap between 1 and the next representable number (2**-24 for float32)."""
    return torch.finfo(dtype).eps / 2


def gamma(dtype: torch.dtype, n: int) -> float:
    """Higham's ``gamma_n = n u / (1 - n u)``: the worst relative error of a sum of ``n`` terms."""
    nu = n * unit_roundoff(dtype)
    assert nu < 1, f"{n} terms exceed what {dtype} can bound"
    return nu / (1 - nu)


def reorder_bound(dtype: torch.dtype, n: int, abs_sum: torch.Tensor | float) -> torch.Tensor | float:
    """Largest difference between two evaluations, in any orders, of sums of ``n`` terms (products
    included) whose absolute values add up to ``abs_sum`` (elementwise when a tensor)."""
    return 2 * gamma(dtype, n) * abs_sum


def abs_dot(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``|a| @ |b|`` in float64: the ``sum|terms|`` of each element of ``a @ b``."""
    return a.double().abs() @ b.double().abs()


def assert_within(got: torch.Tensor, want: torch.Tensor, bound: torch.Tensor | float, what: str = "") -> None:
    """Every element of ``got`` within ``bound`` of ``want``; the message names the worst element."""
    diff = (got.double() - want.double()).abs()
    bound_t = torch.as_tensor(bound, dtype=torch.float64).expand_as(diff)
    over = diff > bound_t
    if bool(over.any()):
        i = int((diff - bound_t).flatten().argmax())
        raise AssertionError(
            f"{what}: {int(over.sum())} of {diff.numel()} elements past the rounding bound; worst "
            f"|diff| {diff.flatten()[i].item():.3e} against a bound of {bound_t.flatten()[i].item():.3e}"
        )


def recurrent_layers(config: dict) -> int:
    """How many layers carry a recurrent state (gated DeltaNet, Mamba2) rather than attention."""
    cfg = config.get("text_config", config)
    layers = int(cfg["num_hidden_layers"])
    types = cfg.get("layer_types") or cfg.get("layers_block_type")
    if isinstance(types, list):
        return sum(t in ("linear_attention", "mamba") for t in types[:layers])
    if cfg.get("model_type") in ("qwen3_next", "qwen3_5_text"):  # the default interval, as the loader reads it
        return layers - layers // int(cfg.get("full_attention_interval", 4))
    return layers if cfg.get("model_type") == "granitemoehybrid" else 0  # Granite: every layer Mamba2 by default


def model_depth(config: dict, context: int = 0) -> int:
    """Operations in series from the embedding to a logit: ``REDUCTIONS_PER_LAYER`` per layer, the final
    norm and the LM head, and for each recurrent layer one state update per position of the ``context``
    (the state at position t went through t updates, each rounding it)."""
    cfg = config.get("text_config", config)
    return REDUCTIONS_PER_LAYER * int(cfg["num_hidden_layers"]) + 2 + recurrent_layers(config) * context


def model_length(config: dict, context: int) -> int:
    """The longest reduction of a forward pass: the widest GEMM's inner size, an attention head's width
    times its heads for the output projection, or the context the attention sums over."""
    cfg = config.get("text_config", config)
    keys = ("hidden_size", "intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    widths = [int(cfg[k]) for k in keys if isinstance(cfg.get(k), int)]
    heads, head_dim = cfg.get("num_attention_heads"), cfg.get("head_dim")
    if isinstance(heads, int) and isinstance(head_dim, int):
        widths.append(heads * head_dim)
    for k in ("kv_lora_rank", "q_lora_rank", "linear_num_value_heads"):
        if isinstance(cfg.get(k), int):
            widths.append(int(cfg[k]))
    return max([*widths, context])


def model_tolerance(
    config: dict, magnitude: float, *, context: int, dtype: torch.dtype = torch.float32, log_softmax: bool = False
) -> float:
    """Bound on ``|ours - reference|`` for logits (or, ``log_softmax``, log-probabilities) of a model of
    ``config`` computed twice in ``dtype`` with sums in other orders, the logits at most ``magnitude`` in
    absolute value, over ``context`` positions (module note: the probabilistic model and its coverage).

    A low-precision ``dtype`` (bfloat16) accumulates in float32 but stores every stage's weights and
    outputs rounded to ``dtype``: two roundings per stage, each a relative perturbation of at most
    ``u(dtype)`` of the stage's result (a perturbation of a reduction's inputs, unlike its accumulation,
    does not grow with the reduction's length), independent across stages."""
    length, depth = model_length(config, context), model_depth(config, context)
    relative = unit_roundoff(torch.float32) * math.sqrt(length * depth)
    if dtype != torch.float32:
        relative += unit_roundoff(dtype) * math.sqrt(2 * depth)
    bound = LAMBDA * relative * magnitude
    return 2 * bound if log_softmax else bound


# A float32 transcendental (exp, log, the sigmoid's exp) is within a few ulps in every libm and vector math
# library (glibc documents <= 4 ulp for exp / log on x86_64); counted as that many roundings.
ELEMENTWISE_ULPS = 4


def norm_tolerance(dtype: torch.dtype, n: int, stages: int = 1) -> float:
    """Bound on the norm-wise relative error ``||got - ref|| / ||ref||`` of a kernel against a float64
    reference on the same inputs, the kernel's elements passing through ``stages`` steps in series, each a
    reduction of at most ``n`` terms accumulated in float32 followed by elementwise work: a transcendental
    within ``ELEMENTWISE_ULPS`` float32 ulps and, for a low-precision ``dtype``, one rounding to it (a
    bfloat16 kernel rounds its probabilities or its output). The accumulations' errors follow the
    probabilistic bound of the module note (independent stages add in quadrature); the roundings are
    bounded outright (relative error at most ``u`` each, so at most ``u`` norm-wise) and add linearly."""
    accumulate = LAMBDA * unit_roundoff(torch.float32) * math.sqrt(n * stages)
    rounding = ELEMENTWISE_ULPS * unit_roundoff(torch.float32)
    if dtype != torch.float32:
        rounding += unit_roundoff(dtype)
    return accumulate + stages * rounding


def log_softmax_bound(logits: torch.Tensor) -> torch.Tensor:
    """Elementwise bound on the error of one float32 evaluation of ``log_softmax(logits)`` over the last
    dimension (``V`` entries), against the exact value: ``x - m - log S`` with ``m`` the row's max and
    ``S = sum exp(x - m)``. ``S`` carries a relative error of at most ``gamma_V`` (its sum) plus
    ``ELEMENTWISE_ULPS`` ulps (each ``exp``), which ``log`` turns into that much absolute error; ``log`` adds
    its own ulps of ``log S``; the two subtractions round once each."""
    x = logits.double()
    u = unit_roundoff(torch.float32)
    shifted = x - x.amax(-1, keepdim=True)
    log_s = torch.logsumexp(shifted, -1, keepdim=True)
    rel_s = gamma(torch.float32, x.shape[-1]) + ELEMENTWISE_ULPS * u
    return rel_s + ELEMENTWISE_ULPS * u * log_s + u * (shifted.abs() + log_s) + u * (shifted - log_s).abs()


def elementwise_bound(ref: torch.Tensor, roundings: int) -> torch.Tensor:
    """Largest difference between two evaluations of an elementwise float32 formula with ``roundings``
    rounded operations (a transcendental counted as ``ELEMENTWISE_ULPS``) whose exact value is ``ref``:
    each is within ``gamma_roundings |ref|`` of it."""
    return 2 * gamma(torch.float32, roundings) * ref.double().abs()


def frequency_bound(p: torch.Tensor, draws: int, sigmas: float = 5.0) -> torch.Tensor:
    """How far the observed frequencies of ``draws`` independent categorical draws may fall from their
    probabilities ``p``: ``sigmas`` binomial standard deviations (5: a false alarm below 6e-7 per class)."""
    return sigmas * torch.sqrt(p.double() * (1 - p.double()) / draws)
