"""FP8 block-quantized checkpoints (as Qwen3-*-FP8, DeepSeek-V3 and GLM-5-FP8 ship them) and dummy weights.

The checkpoints are made by kvwarden's own tooling (``make-model --fp8``), with blocks smaller than the
published 128 x 128 so that tiny models hold many blocks and edge blocks cut by the matrix's end. Their
reference is transformers on the same weights dequantized here, independently of kvwarden's code
(``_dequantized_twin``): kvwarden must agree with it to float32 rounding and hold every property, and
compute bit for bit what it computes on the dequantized twin itself - on the compiled CPU kernels (FP8
dequantized at load) and on the Triton kernels under the interpreter (FP8 kept, dequantized per tile
inside the GEMMs).
"""

from __future__ import annotations

import json
import shutil
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from kvwarden import LLM, SamplingParams
from kvwarden.bench.properties import check_properties
from kvwarden.layers.fp8 import BlockFp8
from kvwarden.models.make_model import make_model
from reference import model_tol
from tolerance import assert_within

BLOCK = (16, 32)
PROMPT = [(7 * i) % 900 + 5 for i in range(45)]


def _dequantized_twin(fp8_dir: Path, out: Path) -> Path:
    """The same checkpoint with every FP8 weight multiplied out by its block scales in float32 (no
    quantization_config): what transformers runs as the reference."""
    cfg = json.loads((fp8_dir / "config.json").read_text())
    bn, bk = cfg.pop("quantization_config")["weight_block_size"]
    weights = load_file(fp8_dir / "model.safetensors")
    dense = {}
    for name, w in weights.items():
        if name.endswith("weight_scale_inv"):
            continue
        scale = weights.get(name.removesuffix("weight") + "weight_scale_inv")
        if scale is not None:
            grid = scale.repeat_interleave(bn, 0).repeat_interleave(bk, 1)[: w.shape[0], : w.shape[1]]
            w = w.to(torch.float32) * grid
        dense[name] = w
    out.mkdir()
    save_file(dense, str(out / "model.safetensors"))
    (out / "config.json").write_text(json.dumps(cfg))
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(fp8_dir / f, out / f)
    return out


@pytest.fixture(scope="module", params=["qwen3", "qwen3_moe"])
def fp8_pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp(f"fp8-{request.param}")
    fp8 = make_model(request.param, "tiny", 0, root / "fp8", fp8_block=BLOCK)
    return fp8, _dequantized_twin(fp8, root / "dense")


def test_the_checkpoint_is_written_as_published_fp8_checkpoints_are(fp8_pair: tuple[Path, Path]) -> None:
    fp8, _ = fp8_pair
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    assert quant["quant_method"] == "fp8" and quant["weight_block_size"] == list(BLOCK)
    weights = load_file(fp8 / "model.safetensors")
    quantized = [n for n, w in weights.items() if w.dtype == torch.float8_e4m3fn]
    assert quantized
    assert all(weights[n.removesuffix("weight") + "weight_scale_inv"].dtype == torch.float32 for n in quantized)
    assert "lm_head.weight" not in quantized
    assert not any(".mlp.gate.weight" in n for n in quantized)  # the router stays in the model's dtype


def test_fp8_agrees_with_transformers_on_the_dequantized_weights(fp8_pair: tuple[Path, Path]) -> None:
    """Greedy tokens equal; every prompt position's log-probabilities within float32 rounding."""
    from transformers import AutoModelForCausalLM

    fp8, dense = fp8_pair
    hf = AutoModelForCausalLM.from_pretrained(dense, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = hf(torch.tensor([PROMPT])).logits[0].float()
        greedy = hf.generate(torch.tensor([PROMPT]), max_new_tokens=8, do_sample=False, eos_token_id=None)
    llm = LLM(str(fp8), block_size=16)
    ours = torch.log_softmax(llm.score(PROMPT).float(), -1)
    assert_within(ours, torch.log_softmax(logits, -1), model_tol(dense, logits, len(PROMPT)), "FP8 vs transformers")
    out = llm.generate([PROMPT], SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))[0]
    assert out.token_ids == greedy[0, len(PROMPT) :].tolist()


@pytest.mark.parametrize("kernels", ["auto", "triton"])
def test_fp8_computes_the_bits_of_its_dequantized_twin(fp8_pair: tuple[Path, Path], kernels: str) -> None:
    """One dequantization rule: at load on the CPU, per tile inside the Triton GEMMs (the weights stay FP8)."""
    fp8, dense = fp8_pair
    make = partial(LLM, kernels=kernels, device="cpu", block_size=8, max_num_batched_tokens=64)
    quantized = make(str(fp8))
    kept = [w for layer in quantized.engine.loaded.model.layers for w in vars(layer.ffn).values()]
    assert any(isinstance(w, BlockFp8) for w in kept) == (kernels == "triton")
    assert torch.equal(quantized.score(PROMPT), make(str(dense)).score(PROMPT))


def test_fp8_keeps_the_invariance_properties(fp8_pair: tuple[Path, Path]) -> None:
    fp8, _ = fp8_pair
    make = partial(LLM, str(fp8), block_size=16, max_num_batched_tokens=64, num_blocks=64)
    params = SamplingParams(temperature=0.8, seed=3, max_tokens=4, logprobs=5, ignore_eos=True)
    partners = [PROMPT[::-1][:20], PROMPT[3:30], [9, 8, 7, 6, 5, 4]]
    report = check_properties(make, PROMPT, params, 16, partners, only=("a", "b", "c", "e", "f", "h"))
    assert report.all_identical, report.failures()


def _edit(src: Path, dst: Path, config: dict | None = None, tensors: dict | None = None) -> Path:
    shutil.copytree(src, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        for key, value in config.items():
            if value is None:
                cfg.pop(key, None)
            else:
                cfg[key] = value
        (dst / "config.json").write_text(json.dumps(cfg))
    if tensors is not None:
        weights = load_file(dst / "model.safetensors")
        for key, value in tensors.items():
            if value is None:
                weights.pop(key)
            else:
                weights[key] = value
        save_file(weights, str(dst / "model.safetensors"))
    return dst


def test_what_kvwarden_cannot_read_is_refused_naming_it(fp8_pair: tuple[Path, Path], tmp_path: Path) -> None:
    fp8, _ = fp8_pair
    quant = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    scale = "model.layers.0.self_attn.q_proj.weight_scale_inv"
    cases = [
        ({"quantization_config": {**quant, "quant_method": "awq"}}, None, r"quant_method 'awq' is not supported"),
        ({"quantization_config": {**quant, "activation_scheme": "static"}}, None, r"activation_scheme 'static'"),
        ({"quantization_config": {**quant, "weight_block_size": None}}, None, r"weight_block_size None"),
        ({"quantization_config": {**quant, "kv_cache_scheme": "fp8"}}, None, r"quantization_config.kv_cache_scheme"),
        ({"quantization_config": None}, None, r"\.weight' is FP8 but config.json has no quantization_config"),
        (None, {scale: None}, r"'model.layers.0.self_attn.q_proj.weight' has no '\S+q_proj.weight_scale_inv'"),
        (None, {scale: torch.ones(1, 1)}, r"weight_scale_inv' has shape \(1, 1\)"),
        ({"quantization_config": {**quant, "modules_to_not_convert": ["q_proj"]}}, None, r"q_proj.weight' is FP8, but"),
    ]  # fmt: skip
    for i, (config, tensors, message) in enumerate(cases):
        with pytest.raises(ValueError, match=message):
            LLM(str(_edit(fp8, tmp_path / str(i), config, tensors)))


def _config_only(src: Path, dst: Path, config: dict | None = None) -> Path:
    dst.mkdir()
    for f in ("tokenizer.json", "tokenizer_config.json", "generation_config.json"):
        shutil.copy(src / f, dst / f)
    (dst / "config.json").write_text(json.dumps(config or json.loads((src / "config.json").read_text())))
    return dst


@pytest.mark.parametrize("family", ["llama", "qwen3_next", "qwen3_moe", "glm_moe_dsa", "granite_hybrid_moe"])
def test_dummy_weights_need_only_the_config_and_a_tokenizer(
    family: str, models_root: Path, tmp_path: Path, llama_tiny: Path
) -> None:
    """Seeded from (seed, tensor name): the same model twice, another with another seed; FP8 ones when the
    config says FP8, which compute what their dequantized weights do."""
    from conftest import _made

    made = _made(models_root, family, "tiny") if family != "llama" else llama_tiny
    folder = _config_only(made, tmp_path / "dummy")
    assert not list(folder.glob("*.safetensors"))
    params = SamplingParams(temperature=0.0, max_tokens=4, logprobs=5, ignore_eos=True)
    a, b = (LLM(str(folder), load_format="dummy").generate([PROMPT[:20]], params)[0] for _ in range(2))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    other = LLM(str(folder), load_format="dummy", seed=1).generate([PROMPT[:20]], params)[0]
    assert other.logprobs != a.logprobs
    cfg = json.loads((folder / "config.json").read_text())
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": [16, 32]}
    quantized = LLM(str(_config_only(made, tmp_path / "fp8", cfg)), load_format="dummy", kernels="triton", device="cpu")
    assert any(
        isinstance(w, BlockFp8) for layer in quantized.engine.loaded.model.layers for w in vars(layer.ffn).values()
    )
    assert quantized.generate([PROMPT[:20]], params)[0].token_ids  # serves


def test_a_model_larger_than_the_machine_is_refused_before_loading(tmp_path: Path, llama_tiny: Path) -> None:
    """GLM-5's 744B parameters (its published shapes) against this host's memory: refused at once, naming
    the shortfall, before a single tensor is drawn."""
    config = json.loads((Path(__file__).parent.parent / "bench" / "configs" / "large" / "glm-5.json").read_text())
    folder = _config_only(llama_tiny, tmp_path / "glm5", config)
    with pytest.raises(ValueError, match=r"the model's weights need \d+\.\d GiB on cpu, but .* short by \d+\.\d GiB"):
        LLM(str(folder), load_format="dummy", dtype="bfloat16")


def test_loading_reports_its_rate(llama_tiny: Path, caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="kvwarden.models.load_plan"):
        llm = LLM(str(llama_tiny))
    assert llm.engine.loaded.load_bytes == (llama_tiny / "model.safetensors").stat().st_size - _header(llama_tiny)
    assert any("GB/s" in r.getMessage() for r in caplog.records)


def _header(model: Path) -> int:
    """A safetensors file's 8-byte length prefix plus its JSON header (the rest is tensor data)."""
    raw = (model / "model.safetensors").read_bytes()[:8]
    return 8 + int.from_bytes(raw, "little")


def test_serve_and_make_model_take_the_flags(tmp_path: Path, llama_tiny: Path) -> None:
    """``kvwarden make-model --fp8`` writes an FP8 checkpoint; ``kvwarden serve --load-format dummy`` serves a
    folder without weights to the official client; a bad ``--fp8`` is refused naming the flag."""
    import subprocess
    import sys

    import openai

    from server_util import running_server

    cli = [sys.executable, "-m", "kvwarden.cli", "make-model"]
    run = partial(subprocess.run, capture_output=True, text=True, check=False)
    done = run([*cli, "--arch", "qwen3", "--fp8", "16,32", "--out", str(tmp_path / "m")])
    assert done.returncode == 0, done.stderr
    assert "FP8 blocks 16,32" in done.stdout
    quant = json.loads((tmp_path / "m" / "config.json").read_text())["quantization_config"]
    assert quant["weight_block_size"] == [16, 32]
    bad = run([*cli, "--arch", "qwen3", "--fp8", "16", "--out", str(tmp_path / "x")])
    assert bad.returncode == 2 and "--fp8: expected BN,BK" in bad.stderr
    folder = _config_only(llama_tiny, tmp_path / "dummy")
    with running_server(str(folder), "--load-format", "dummy", "--served-model-name", "d") as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused")
        out = client.completions.create(model="d", prompt="Hello", max_tokens=4, temperature=0.0, logprobs=3)
        assert out.usage.completion_tokens == 4 and len(out.choices[0].logprobs.top_logprobs) == 4


def test_the_scale_bench_runs_end_to_end(tmp_path: Path) -> None:
    """``kvwarden bench scale`` on a tiny MoE as FP8 (the GPU check runs it at full size): a table,
    a JSON line, invariance (b), (e), (f) bitwise."""
    import subprocess
    import sys

    from kvwarden.models.family_presets import family_config

    config = tmp_path / "config.json"
    config.write_text(json.dumps(family_config("qwen3_moe", "tiny", vocab=1024, eos=2, bos=1)))
    cmd = [sys.executable, "-m", "kvwarden.bench.scale", "--config", str(config), "--fp8", "16,32", "--dtype",
           "float32", "--device", "cpu", "--input-len", "24", "--output-len", "6", "--offline-requests", "3",
           "--concurrency", "1", "2", "--out", str(tmp_path / "scale.json")]  # fmt: skip
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=600)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result == json.loads((tmp_path / "scale.json").read_text())
    assert result["invariance"] == {"b": True, "e": True, "f": True}
    assert [o["concurrency"] for o in result["online"]] == [1, 2] and all(o["failed"] == 0 for o in result["online"])
    assert "offline output tok/s" in done.stdout
