"""The lightning indexer at the head counts and head sizes checkpoints use, with pruning active, against
transformers' ``GlmMoeDsaForCausalLM`` / ``DeepseekV32ForCausalLM`` in float32.

An indexer with few heads gives many keys an index score of exactly ``0`` (every head's dot product
non-positive, summed through a ReLU: one key in ``2**H``). When the ``k``-th best score is such a zero, the
selected set is not determined by the scores: kvwarden takes the lower positions (``select_topk``), the
reference takes whatever ``torch.topk``'s sort leaves in front. So the reference is run twice: as shipped,
counting how often equal scores decided its selection, and with its indexers breaking ties to the lower
position (``reference.canonical_indexer_ties``, the scores still its own); the second must agree with
kvwarden to float32 rounding at every position, and the first may only differ where ties occurred.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch

from kvwarden import LLM
from kvwarden.models.family_presets import family_config
from reference import canonical_indexer_ties, hybrid_init, model_tol, save_random_checkpoint
from tolerance import assert_within

TOPK = 32  # prunes: the prompts are 80-400 tokens
# (family, indexer heads, indexer head size): every head count 1-64 at GLM-5's and DeepSeek-V3.2's head size
# ratio to this model, then head sizes 32-128 (32 = the rotary slice alone) at the head counts that tie most.
SHAPES = [("glm_moe_dsa", h, 64) for h in (1, 2, 4, 8, 16, 32, 64)]
SHAPES += [("glm_moe_dsa", 4, d) for d in (32, 48, 96, 128)]
SHAPES += [("glm_moe_dsa", 2, 128), ("deepseek_v32", 4, 64), ("deepseek_v32", 1, 128)]


def _checkpoint(tmp_path: Path, tokenizer_dir: Path, family: str, heads: int, dim: int) -> Path:
    from transformers import DeepseekV32Config, GlmMoeDsaConfig

    cfg = family_config(family, "small", vocab=1024, eos=2, bos=1)
    for key in ("architectures", "model_type", "dtype"):
        cfg.pop(key)
    cfg |= {"index_n_heads": heads, "index_head_dim": dim, "index_topk": TOPK, "num_hidden_layers": 2}
    if "indexer_types" in cfg:
        cfg["indexer_types"] = ["full", "shared"]
    config = (GlmMoeDsaConfig if family == "glm_moe_dsa" else DeepseekV32Config)(**cfg)
    return save_random_checkpoint(config, tmp_path / "ckpt", tokenizer_dir, hybrid_init)


@pytest.mark.parametrize(("family", "heads", "dim"), SHAPES)
def test_indexer_shapes_agree_with_transformers_while_pruning(
    tmp_path: Path, llama_tiny: Path, family: str, heads: int, dim: int
) -> None:
    from transformers import AutoModelForCausalLM

    model_dir = _checkpoint(tmp_path, llama_tiny, family, heads, dim)
    assert json.loads((model_dir / "config.json").read_text())["index_n_heads"] == heads
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    llm = LLM(str(model_dir), block_size=16)
    rng = random.Random(heads * 1000 + dim)
    for n in (80, rng.randint(150, 400)):
        prompt = [rng.randrange(3, 1000) for _ in range(n)]
        ids = torch.tensor([prompt])
        with torch.no_grad(), canonical_indexer_ties(hf) as ties:
            logits = hf(ids).logits[0].float()
        with torch.no_grad(), canonical_indexer_ties(hf, canonical=False) as shipped_ties:
            shipped = torch.log_softmax(hf(ids).logits[0].float(), -1)
        # the same selections made (a later layer's scores follow an earlier layer's choice, so the tie counts
        # of the two runs may differ past the first indexer)
        assert ties.rows == shipped_ties.rows > 0
        ref = torch.log_softmax(logits, -1)
        ours = torch.log_softmax(llm.score(prompt).float(), -1)
        tol = model_tol(model_dir, logits, n)
        assert_within(ours, ref, tol, f"{family}, {heads} heads of {dim}, {n} tokens, ties to the lower position")
        worst_shipped = (ours - shipped).abs().max().item()
        print(f"\n[indexer {family} {heads}x{dim} n={n}] tied rows {shipped_ties.tied_rows}/{ties.rows}; "
              f"against torch.topk's choice {worst_shipped:.2e} nats, bound {tol:.2e}")  # fmt: skip
        if worst_shipped > tol:  # as shipped, the reference may only differ where equal scores chose
            assert shipped_ties.tied_rows > 0, worst_shipped
