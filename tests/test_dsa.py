"""GLM-5's sparse attention (``GlmMoeDsaForCausalLM``): the latent cache, the indexer's selection, and the
guarantee on top of them (agreement with transformers and (a)-(i) run in ``tests/test_families.py``).
"""

from __future__ import annotations

import json
import random
from functools import partial
from pathlib import Path

import pytest
import torch

from conftest import _made
from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import check_properties
from kvwarden.layers.sparse_attention import index_scores, select_keys, select_topk
from reference import model_tol
from tolerance import assert_within, reorder_bound

BLOCK = 16


@pytest.fixture(scope="module")
def glm_tiny(models_root: Path) -> Path:
    return _made(models_root, "glm_moe_dsa", "tiny")


def _prompt(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 1000) for _ in range(n)]


def _with(src: Path, dst: Path, **edit: object) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    cfg = json.loads((dst / "config.json").read_text()) | edit
    (dst / "config.json").write_text(json.dumps(cfg))
    return dst


def test_selection_is_a_function_of_the_scores_alone() -> None:
    """Ties go to the lower position (the set: score, then position), returned in position order, whatever rows
    share the call."""
    g = torch.Generator().manual_seed(0)
    scores = torch.randint(0, 4, (16, 300), generator=g).float()  # four values: ties everywhere
    values, cols = select_topk(scores, 20, deterministic=True)
    for r in range(16):
        want = sorted(range(300), key=lambda j: (-scores[r, j].item(), j))[:20]
        assert cols[r].tolist() == sorted(want)
        alone = select_topk(scores[r : r + 1], 20, deterministic=True)[1]
        assert torch.equal(alone[0], cols[r])
    assert torch.equal(values, scores.gather(1, cols))
    # rows without ties (the library's answer stands), with ties, and short of finite scores, in one call
    mixed = torch.randn(6, 300, generator=g)
    mixed[1, 40:60] = mixed[1, 5]  # ties at the top
    mixed[2, 100:] = float("-inf")
    mixed[3] = torch.randint(0, 3, (300,), generator=g).float()
    ranked = torch.sort(mixed, dim=-1, descending=True, stable=True).indices[:, :250]
    reference = torch.sort(ranked, dim=-1).values  # the set, in position order
    values, cols = select_topk(mixed, 250, deterministic=True)
    assert torch.equal(cols, reference) and torch.equal(values, mixed.gather(1, reference))


def test_a_short_context_is_filled_with_invisible_candidates() -> None:
    scores = torch.tensor([[0.5, float("-inf"), float("-inf")], [0.1, 0.9, float("-inf")]])
    positions, visible = select_keys(scores, 5)
    assert visible.tolist() == [[True, False, False, False, False], [True, True, False, False, False]]
    assert positions[1, :2].tolist() == [0, 1]  # position order


def test_index_scores_do_not_depend_on_the_chunk() -> None:
    """A query's scores are the same bits computed alone, in a chunk, or over a longer key table."""
    g = torch.Generator().manual_seed(1)
    t, h, d, n = 24, 6, 32, 40
    q, keys, w = torch.randn(t, h, d, generator=g), torch.randn(n, d, generator=g), torch.randn(t, h, generator=g)
    whole = index_scores(q, keys[:t], w, d**-0.5, 0)
    for i in (0, 5, 23):
        alone = index_scores(q[i : i + 1], keys[: i + 1], w[i : i + 1], d**-0.5, i)
        assert torch.equal(alone[0], whole[i, : i + 1])
        longer = index_scores(q[i : i + 1], keys, w[i : i + 1], d**-0.5, i)
        assert torch.equal(longer[0, : i + 1], alone[0])
        assert torch.isinf(longer[0, i + 1 :]).all()


def test_the_cache_holds_one_latent_row_and_one_indexer_key_per_token(glm_tiny: Path) -> None:
    cfg = json.loads((glm_tiny / "config.json").read_text())
    llm = LLM(str(glm_tiny), block_size=BLOCK, num_blocks=16)
    latent, index = llm.engine.runner.kv_caches.raw(0)
    assert latent.shape[1:] == (1, cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"])
    assert index.shape[1:] == (1, cfg["index_head_dim"])
    per_head = cfg["num_attention_heads"] * (2 * (cfg["qk_nope_head_dim"] + cfg["qk_rope_head_dim"]))
    ours = latent.shape[2] + index.shape[2]
    print(f"\n[dsa] cache floats per token and layer: {ours} (per-head K and V: {per_head})")


def test_selection_prunes_at_the_presets_lengths(glm_tiny: Path, tmp_path: Path) -> None:
    """With every key selected the answer changes from position index_topk on, and only from there."""
    topk = json.loads((glm_tiny / "config.json").read_text())["index_topk"]
    prompt = _prompt(1, 40)
    logits = LLM(str(glm_tiny)).score(prompt).float()
    sparse = torch.log_softmax(logits, -1)
    dense_model = _with(glm_tiny, tmp_path / "dense", index_topk=4096)
    dense = torch.log_softmax(LLM(str(dense_model)).score(prompt).float(), -1)
    diff = (sparse - dense).abs().amax(-1)
    # every key selected either way, summed in another order: within float32's rounding bound (tests/tolerance.py)
    assert diff[:topk].max().item() <= model_tol(glm_tiny, logits, len(prompt))
    assert diff[topk:].max().item() > 0.1


@pytest.mark.parametrize("method", ["ngram", "mtp"])
def test_speculation_on_equals_off(glm_tiny: Path, method: str) -> None:
    """(j): n-gram drafts, or the checkpoint's own MTP layer (DeepSeek's layout: layer ``num_hidden_layers``,
    its latent attention selecting its own keys), verified through the sparse attention, (b)-(h) against
    the run without them."""
    rng = random.Random(3)
    motif = [rng.randrange(3, 1000) for _ in range(6)]
    prompt = (motif * 6)[:33]
    partners = [_prompt(s, 20) for s in (4, 5)]
    params = SamplingParams(temperature=0.0, max_tokens=10, logprobs=5, ignore_eos=True)
    ref = LLM(str(glm_tiny), block_size=BLOCK, enable_prefix_caching=False).generate([prompt], params)[0]
    spec = {"method": method, "num_speculative_tokens": 3 if method == "ngram" else 2}
    make = partial(LLM, str(glm_tiny), block_size=BLOCK, num_blocks=64, speculative_config=spec)
    report = check_properties(make, prompt, params, BLOCK, partners, only=("b", "c", "e", "f", "g"), reference=ref)
    assert report.all_identical, report.failures()
    if method == "mtp":  # the head really drafted (its random weights are rarely right)
        llm = make()
        llm.generate([prompt], params)
        assert llm.engine.stats()["spec_num_draft_tokens"] > 0


def test_the_mtp_layer_is_loaded_only_where_the_config_announces_it(glm_tiny: Path, tmp_path: Path) -> None:
    """Without ``num_nextn_predict_layers`` layer 3's tensors are a layer past the stack: refused, naming one;
    a tensor of the MTP layer its head would not read is refused when speculation loads the head."""
    from safetensors.torch import load_file, save_file

    with pytest.raises(ValueError, match=r"tensor 'model\.layers\.3\."):
        LLM(str(_with(glm_tiny, tmp_path / "without", num_nextn_predict_layers=0)))
    model = _with(glm_tiny, tmp_path / "extra")
    weights = load_file(model / "model.safetensors")
    weights["model.layers.3.mlp.experts.0.extra.weight"] = torch.zeros(4)
    save_file(weights, str(model / "model.safetensors"))
    LLM(str(model))  # not read without speculation: the model itself is whole
    with pytest.raises(ValueError, match=r"MTP tensor 'model\.layers\.3\.mlp\.experts\.0\.extra\.weight'"):
        LLM(str(model), speculative_config={"method": "mtp", "num_speculative_tokens": 2})


def test_the_first_incident_on_demand(glm_tiny: Path) -> None:
    """``unsafe_topk`` (bfloat16 index scores, ties in arrival order): answers follow the batch; kvwarden's
    selection: bitwise the same alone and batched."""
    prompts = [_prompt(10 + i, 30 + 7 * i) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=12, logprobs=5, ignore_eos=True)
    moved = {}
    for unsafe in (False, True):
        llm = LLM(str(glm_tiny), block_size=BLOCK, enable_prefix_caching=False, unsafe_topk=unsafe)
        alone = [llm.generate([p], params)[0] for p in prompts]
        batched = llm.generate(prompts, params)
        moved[unsafe] = sum(a.logprobs != b.logprobs for a, b in zip(alone, batched, strict=True))
    print(f"\n[dsa] requests whose logprobs moved when batched: unsafe_topk {moved[True]}/4, kvwarden {moved[False]}/4")
    assert moved[False] == 0
    assert moved[True] > 0


def test_bfloat16_scores_tie_where_float32_scores_do_not() -> None:
    """How often the k-th and the next score are equal: the ties the incident needs (printed, and present)."""
    g = torch.Generator().manual_seed(3)
    scores = torch.randn(2048, 256, generator=g).abs() * 3
    k = 32
    ties = {}
    for dtype in (torch.float32, torch.bfloat16):
        top = torch.sort(scores.to(dtype).float(), dim=-1, descending=True).values
        ties[dtype] = (top[:, k - 1] == top[:, k]).float().mean().item()
    f32, bf16 = ties[torch.float32], ties[torch.bfloat16]
    print(f"\n[dsa] rows tied at the top-{k} boundary of 256 scores: float32 {f32:.1%}, bf16 {bf16:.1%}")
    assert ties[torch.float32] == 0.0 and ties[torch.bfloat16] > 0.01


@pytest.mark.parametrize(
    ("edit", "field"),
    [
        ({"rope_parameters": {"rope_type": "linear", "factor": 4.0, "rope_theta": 1e4}}, "rope_type"),
        ({"indexer_types": ["full", "sparse", "full"]}, "indexer_types"),
        ({"indexer_types": ["shared", "full", "full"]}, r"indexer_types\[0\]"),
        ({"n_group": 3}, "n_group"),
        ({"q_lora_rank": None}, "q_lora_rank"),
        ({"num_nextn_predict_layers": 2}, "num_nextn_predict_layers"),
    ],
)
def test_what_it_cannot_serve_is_refused_naming_the_field(
    glm_tiny: Path, tmp_path: Path, edit: dict, field: str
) -> None:
    with pytest.raises(ValueError, match=field):
        LLM(str(_with(glm_tiny, tmp_path / "m", **edit)))


def test_deepseek_v32_runs_every_indexer(models_root: Path, tmp_path: Path) -> None:
    """DeepSeek-V3.2 has no shared selections: a config asking for one is refused, naming the field."""
    model = _made(models_root, "deepseek_v32", "tiny")
    with pytest.raises(ValueError, match="indexer_types"):
        LLM(str(_with(model, tmp_path / "m", indexer_types=["full", "shared", "full"])))


def test_a_misshaped_latent_projection_is_refused_naming_it(glm_tiny: Path, tmp_path: Path) -> None:
    from safetensors.torch import load_file, save_file

    model = _with(glm_tiny, tmp_path / "m")
    weights = load_file(model / "model.safetensors")
    name = "model.layers.0.self_attn.kv_b_proj.weight"
    weights[name] = weights[name][:-1].contiguous()
    save_file(weights, str(model / "model.safetensors"))
    with pytest.raises(ValueError, match=f"tensor '{name}' has shape"):
        LLM(str(model))


def test_both_caches_travel_through_the_host_tier(glm_tiny: Path) -> None:
    """A prefix served from host memory gives the cold answer (the latent rows and the indexer keys load
    together, behind the layer's wait); reading before the load lands gives another."""
    from kvwarden.models.bundled import documents

    words = [w for d in documents() for w in d.text.split()]
    a = " ".join(words[:150])
    b = " ".join(words[:120] + words[5000:5030])
    fillers = [" ".join(words[1000 + 200 * i : 1150 + 200 * i]) for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=5, ignore_eos=True)
    cold = LLM(str(glm_tiny), enable_prefix_caching=False).generate([b], params)[0].logprobs
    same = {}
    for unsafe in (False, True):
        llm = LLM(str(glm_tiny), num_blocks=40, host_cache_bytes=64 << 20, unsafe_host_load=unsafe)
        llm.engine.host.copies.load_delay_s = 0.3  # every load lands late: the unsafe read certainly wins the race
        llm.generate([a, *fillers], params)
        out = llm.generate([b], params)[0]
        assert llm.engine.stats()["prefix_cache_hits_host"] >= 96
        same[unsafe] = out.logprobs == cold
        llm.engine.check_integrity()
    assert same == {False: True, True: False}


def test_the_gpu_preset_has_glm5s_attention_shape_and_others_refuse_it() -> None:
    from kvwarden.models.config import ModelConfig
    from kvwarden.models.family_presets import family_config

    for arch in ("glm_moe_dsa", "deepseek_v32"):
        cfg = ModelConfig.from_dict(family_config(arch, "0.6b", 151936, 2, 1))
        mla = cfg.mla
        assert mla is not None and cfg.vocab_size == 151936
        assert (mla.kv_lora_rank, mla.qk_rope_head_dim, mla.qk_nope_head_dim, mla.v_head_dim) == (512, 64, 192, 256)
        assert (mla.index_n_heads, mla.index_head_dim, mla.index_topk) == (32, 128, 2048)
    with pytest.raises(ValueError, match=r"--preset: qwen2 has the presets tiny, small, not '0.6b'"):
        family_config("qwen2", "0.6b", 1024, 2, 1)


def test_absorbed_projections_by_head_on_every_backend() -> None:
    """MLA's per-head projections (``Ops.linear_heads``): the base backends' one GEMM per head, and the GPU
    fast path's batched cuBLAS form (run here on CPU tensors) giving the same product within rounding, over a
    strided view of a wider projection as the block passes it."""
    from kvwarden.config import NumericsConfig
    from kvwarden.layers.gpu_ops import CudaOps
    from kvwarden.layers.numerics import Ops

    g = torch.Generator().manual_seed(5)
    x = torch.randn(5, 3, 12, generator=g)[..., :10]  # q_nope: the first 10 of each head's 12 columns
    w = torch.randn(3, 7, 10, generator=g)
    config = NumericsConfig(mode="shape-dependent")
    per_head = Ops(config).linear_heads(x, w)
    assert per_head.shape == (5, 3, 7)
    for h in range(3):
        assert torch.equal(per_head[:, h], Ops(config).linear(x[:, h].contiguous(), w[h]))
    batched = CudaOps(config, torch.device("cpu")).linear_heads(x, w)
    assert batched.shape == (5, 3, 7)
    exact = torch.einsum("mhk,hnk->mhn", x.double(), w.double())
    bound = reorder_bound(torch.float32, 10, torch.einsum("mhk,hnk->mhn", x.double().abs(), w.double().abs()))
    assert_within(batched, exact, bound / 2, "batched heads against the exact product")  # one evaluation: gamma_n
    assert_within(batched, per_head, bound, "batched heads against one GEMM per head")
