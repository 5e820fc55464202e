"""The sweep over published model configurations: load, agreement with transformers, an invariance subset.

For each ``config.json`` (``bench/configs/``: SmolLM2, Llama 3.2, Qwen2.5, Qwen3,
Qwen3-MoE, Qwen3-Next, Granite 4.0-H, Mistral) a random checkpoint of its exact
shapes is written with ``make-model --config`` (its first layers only, every
other dimension kept), loaded by kvwarden's real loader, compared with
transformers' own implementation on greedy continuations (tokens and top-20
logprobs), and run through a few of the invariance properties. A config kvwarden
cannot serve must be refused at load with a message naming the config field.

Used by ``tests/test_real_configs.py`` (CPU, float32) and ``kvwarden bench sweep``
(the table in docs/models.md; ``--device cuda`` in ``scripts/gpu_check.sh``).
"""

from __future__ import annotations

import gc
import random
import shutil
import statistics
import time
from dataclasses import dataclass, field, replace
from functools import partial
from pathlib import Path
from typing import Any

import torch

from kvwarden.bench.properties import check_properties
from kvwarden.engine.sampling_params import SamplingParams
from kvwarden.llm import LLM
from kvwarden.models.config import ModelConfig

LIKELY = -5.0  # logprobs at or above this are tokens sampling can pick


@dataclass
class SweepRow:
    """One configuration's result."""

    name: str
    dtype: str = "float32"  # the compute dtype of both engines
    architecture: str = ""
    shape: str = ""
    status: str = "agrees"  # agrees | differs | refused | error
    detail: str = ""
    prompts: int = 0
    greedy_equal: int = 0
    max_dlogprob_likely: float = 0.0
    max_dlogprob_top20: float = 0.0
    max_abs_logit: float = 0.0  # transformers' largest |logit|: the magnitude a rounding bound scales with
    invariance: dict[str, bool] = field(default_factory=dict)
    seconds: float = 0.0


def shape_of(cfg: ModelConfig) -> str:
    """A one-line description of the geometry a kernel sees."""
    parts = [f"h {cfg.hidden_size}", f"heads {cfg.num_attention_heads}/{cfg.num_key_value_heads} x {cfg.head_dim}"]
    if cfg.rotary_dim != cfg.head_dim:
        parts.append(f"rope {cfg.rotary_dim}")
    if cfg.moe is not None:
        parts.append(f"experts {cfg.moe.num_experts} top {cfg.moe.top_k}")
    if cfg.gated_deltanet is not None:
        g = cfg.gated_deltanet
        parts.append(f"GDN {g.num_key_heads}/{g.num_value_heads} x {g.key_head_dim}")
    if cfg.mamba2 is not None:
        parts.append(f"Mamba2 {cfg.mamba2.num_heads} x {cfg.mamba2.head_dim}, state {cfg.mamba2.state_size}")
    parts.append(f"vocab {cfg.vocab_size}" + (" tied" if cfg.tie_word_embeddings else ""))
    return ", ".join(parts)


def sweep_config(
    name: str,
    config: dict[str, Any],
    workdir: Path,
    *,
    dtype: str = "float32",
    tol: float = 1e-3,
    **kw: Any,
) -> SweepRow:
    """One configuration in one compute dtype: :func:`sweep_config_dtypes` with ``[(dtype, tol)]``."""
    return sweep_config_dtypes(name, config, workdir, dtypes=((dtype, tol),), **kw)[0]


def sweep_config_dtypes(
    name: str,
    config: dict[str, Any],
    workdir: Path,
    *,
    dtypes: tuple[tuple[str, float], ...] = (("float32", 1e-3),),
    layers: int = 2,
    prompts: int = 8,
    tokens: int = 32,
    device: str = "cpu",
    weights_dtype: str = "bfloat16",
    max_experts: int | None = None,
    properties: tuple[str, ...] = ("b", "e", "f"),
) -> list[SweepRow]:
    """Write one configuration's checkpoint once, then load, compare and check it in each ``(dtype, bound)``.

    ``max_experts`` caps a MoE's expert count (memory and the time to write the weights); the bound is the
    largest |Δ logprob| allowed over likely tokens (ten times it over the whole top-20).
    """
    from kvwarden.models.make_model import make_model_from_config

    base = SweepRow(name)
    start = time.perf_counter()
    config = dict(config)
    if max_experts:
        for key in ("num_experts", "num_local_experts"):
            if int(config.get(key) or 0) > max_experts:
                config[key] = max_experts
                base.detail = f"{key} cut to {max_experts} (memory); "
    out = workdir / name
    try:
        make_model_from_config(config, out, seed=0, num_layers=layers, dtype=weights_dtype)
        cfg = ModelConfig.from_dir(out)
    except ValueError as e:  # refused at load: the message must name the field
        base.status, base.detail = "refused", str(e)
        base.seconds = time.perf_counter() - start
        shutil.rmtree(out, ignore_errors=True)
        return [replace(base, dtype=dt) for dt, _ in dtypes]
    base.architecture, base.shape = cfg.architecture, shape_of(cfg)
    written = time.perf_counter() - start  # writing is shared: every dtype's row includes it in its seconds
    rows = []
    try:
        for dt, tol in dtypes:
            row = replace(base, dtype=dt, invariance={})
            _check(row, out, cfg, prompts, tokens, device, dt, tol, properties)
            row.seconds = written + row.seconds
            rows.append(row)
    finally:
        shutil.rmtree(out, ignore_errors=True)
        gc.collect()
    return rows


def _check(
    row: SweepRow,
    out: Path,
    cfg: ModelConfig,
    prompts: int,
    tokens: int,
    device: str,
    dtype: str,
    tol: float,
    properties: tuple[str, ...],
) -> None:
    """Agreement with transformers and the invariance subset, in one dtype; a crash is a result, with its cause."""
    start = time.perf_counter()
    try:
        rng = random.Random(0)
        vocab = min(cfg.vocab_size, 1000)
        lengths = [rng.randint(16, 48) for _ in range(prompts)]
        batch = [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]
        refs = _transformers(out, batch, tokens, device, dtype)
        row.max_abs_logit = max(peak for _, _, peak in refs)
        _agreement(row, out, batch, refs, tokens, device, dtype)
        if row.max_dlogprob_likely > tol:
            row.status, row.detail = "differs", row.detail + f"; likely tokens past the bound {tol:g}"
        if row.max_dlogprob_top20 > 10 * tol:
            row.status, row.detail = "differs", row.detail + f"; top-20 past 10x the bound ({10 * tol:g})"
        if properties:
            _invariance(row, out, device, dtype, properties)
            failed = [k for k, same in row.invariance.items() if not same]
            if failed:
                row.status, row.detail = "differs", row.detail + f"; properties {', '.join(failed)} not bitwise"
    except Exception as e:  # a crash is a result of the sweep, reported with its cause
        row.status, row.detail = "error", row.detail + f"{type(e).__name__}: {e}"
    finally:
        gc.collect()
    row.seconds = time.perf_counter() - start


def _transformers(path: Path, batch: list[list[int]], tokens: int, device: str, dtype: str) -> list[tuple]:
    """transformers' greedy continuation of every prompt, with the log-softmax of each step."""
    from transformers import AutoModelForCausalLM

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype)).to(device).eval()
    refs = []
    with torch.no_grad():
        for prompt in batch:
            ids = torch.tensor([prompt], device=device)
            out = hf.generate(
                ids, max_new_tokens=tokens, do_sample=False, eos_token_id=None, output_logits=True,
                return_dict_in_generate=True, pad_token_id=0,
            )  # fmt: skip
            steps = [torch.log_softmax(x[0].float(), -1).cpu() for x in out.logits]
            peak = max(x[0].float().abs().max().item() for x in out.logits)
            refs.append((out.sequences[0, len(prompt) :].tolist(), steps, peak))
    del hf
    gc.collect()
    return refs


def _agreement(row: SweepRow, path: Path, batch: list, refs: list, tokens: int, device: str, dtype: str) -> None:
    llm = LLM(str(path), device=device, dtype=dtype, max_model_len=128, block_size=16)
    params = SamplingParams(temperature=0.0, max_tokens=tokens, logprobs=20, ignore_eos=True)
    outs = llm.generate(batch, params)
    worst = []
    for (hf_tokens, hf_lp, _), out in zip(refs, outs, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(hf_tokens, out.token_ids, strict=True)) if a != b), None)
        row.greedy_equal += first is None
        upto = len(hf_tokens) if first is None else first + 1
        pairs = [(lp, abs(lp - float(hf_lp[i][t]))) for i in range(upto) for t, lp in (out.logprobs or [])[i]]
        worst.append(max((d for lp, d in pairs if lp >= LIKELY), default=0.0))
        row.max_dlogprob_top20 = max([row.max_dlogprob_top20] + [d for _, d in pairs])
    row.prompts = len(batch)
    row.max_dlogprob_likely = max(worst)
    row.detail += f"median max |Δ| {statistics.median(worst):.2e}"
    del llm
    gc.collect()


def _invariance(row: SweepRow, path: Path, device: str, dtype: str, only: tuple[str, ...]) -> None:
    rng = random.Random(1)
    prompt = [rng.randrange(3, 1000) for _ in range(37)]  # two blocks of 16 and a partial one
    partners = [[rng.randrange(3, 1000) for _ in range(n)] for n in (9, 13, 6)]
    make = partial(LLM, str(path), device=device, dtype=dtype, block_size=16, max_model_len=128, num_blocks=64)
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    report = check_properties(make, prompt, params, 16, partners, only)
    row.invariance = {k: o.identical for k, o in report.outcomes.items()}
    gc.collect()
