"""The probe against engines nobody here wrote: llama.cpp's llama-server and vLLM's CPU build.

Installed by ``scripts/build_llama_server.sh`` and ``scripts/install_vllm.sh``
(``make test`` runs both first). The assertions pin what the probe must detect
on configurations measured unstable here, and must not flag on ones measured
stable (see the README's probe results); a missing engine is a failure, not a
skip.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvwarden import LLM, SamplingParams
from kvwarden.models.make_model import make_model
from kvwarden.models.sources import smollm2_path
from kvwarden.probe.gguf_convert import convert_to_gguf
from kvwarden.probe.launchers import engines_dir

pytestmark = pytest.mark.slow

LLAMA_SERVER = engines_dir() / "llama.cpp" / "build" / "bin" / "llama-server"
VLLM_PYTHON = engines_dir() / "vllm" / "bin" / "python"
FA_OFF = ["--server-arg=-fa", "--server-arg=off", "--server-arg=-np", "--server-arg=1"]
SHAPE = ["--a-len", "300", "--b-len", "420", "--shared", "260"]


def probe(out: Path, *args: str) -> tuple[int, dict]:
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--json", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    assert done.returncode in (0, 1), f"probe failed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return done.returncode, summary


def arms(summary: dict) -> dict[str, dict]:
    return {a["arm"]: a for a in summary["arms"]}


@pytest.fixture(scope="module")
def llama_server() -> Path:
    assert LLAMA_SERVER.is_file(), f"{LLAMA_SERVER} missing: run scripts/build_llama_server.sh (make test does)"
    return LLAMA_SERVER


@pytest.fixture(scope="module")
def converted_llama(llama_server: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("gguf")
    hf = make_model("llama", "small", 0, root / "llama-small")
    return hf, convert_to_gguf(hf, root / "llama-small.gguf")


def test_converted_checkpoint_loads_in_kvwarden_identically(converted_llama: tuple[Path, Path]) -> None:
    hf, gguf = converted_llama
    params = SamplingParams(temperature=0.0, max_tokens=8, logprobs=20, ignore_eos=True)
    prompt = list(range(40, 120))
    a, b = (LLM(str(m)).generate([prompt], params)[0] for m in (hf, gguf))
    assert a.token_ids == b.token_ids
    assert a.logprobs == b.logprobs  # the converter keeps float32 weights bit for bit


def test_llama_cpp_default_settings_are_flagged(llama_server: Path, tmp_path: Path) -> None:
    model = str(smollm2_path())
    code, repeat = probe(
        tmp_path / "repeat", "--launcher", "llama.cpp", "--model", model, "--scenario", "repeat", *SHAPE
    )
    assert code == 1
    rep = arms(repeat)["repeat"]
    assert not rep["stable"] and rep["first_divergent_token"] == 0
    assert rep["cached_tokens"][0] == 0 and all(c == 419 for c in rep["cached_tokens"][1:])
    code, batch = probe(tmp_path / "batch", "--launcher", "llama.cpp", "--model", model, "--scenario", "batch", *SHAPE)
    assert code == 1 and not arms(batch)["among-noise"]["stable"]
    assert batch["cross_arm"] == {"among-noise": False}


def test_llama_cpp_without_flash_attention_and_one_slot_is_stable_on_smollm2(
    llama_server: Path, tmp_path: Path
) -> None:
    model = str(smollm2_path())
    for scenario in ("repeat", "contamination", "batch"):
        code, summary = probe(
            tmp_path / scenario, "--launcher", "llama.cpp", "--model", model, "--scenario", scenario, *SHAPE, *FA_OFF
        )
        assert code == 0, (scenario, summary)
        assert all(summary["cross_arm"].values()), (scenario, summary)


def test_llama_cpp_on_our_float32_llama_is_flagged_even_without_flash_attention(
    converted_llama: tuple[Path, Path], tmp_path: Path
) -> None:
    _, gguf = converted_llama
    code, summary = probe(
        tmp_path / "c", "--launcher", "llama.cpp", "--model", str(gguf), "--scenario", "contamination", *SHAPE, *FA_OFF
    )
    assert code == 1
    a = arms(summary)
    assert not a["clean"]["stable"] and a["clean"]["first_divergent_token"] == 0
    assert a["no-cache"]["stable"]


@pytest.fixture(scope="module")
def vllm_ready() -> Path:
    assert VLLM_PYTHON.is_file(), f"{VLLM_PYTHON} missing: run scripts/install_vllm.sh (make test does)"
    return VLLM_PYTHON


@pytest.fixture(scope="module")
def compat_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """Checkpoints with head sizes vLLM's CPU kernels accept (the tiny presets' 16 is not)."""
    root = tmp_path_factory.mktemp("vllm-models")
    return {
        "llama": make_model("llama", "small", 0, root / "llama"),
        "qwen3_next": make_model("qwen3_next", "compat", 0, root / "qwen3_next"),
    }


VLLM_SHAPE = ["--block-size", "32", "--a-len", "60", "--b-len", "100", "--shared", "40", "--repeats", "4"]


def test_vllm_cpu_dense_is_stable_under_cache_and_batch(
    vllm_ready: Path, compat_models: dict[str, Path], tmp_path: Path
) -> None:
    model = str(compat_models["llama"])
    code, cont = probe(
        tmp_path / "c", "--launcher", "vllm", "--model", model, "--scenario", "contamination", *VLLM_SHAPE
    )
    assert code == 0, cont
    a = arms(cont)
    assert a["clean"]["cached_tokens"] == [0, 96, 96, 96] and a["contaminated"]["cached_tokens"][0] == 32
    assert cont["cross_arm"] == {"contaminated": True}
    code, batch = probe(tmp_path / "b", "--launcher", "vllm", "--model", model, "--scenario", "batch", *VLLM_SHAPE)
    assert code == 0 and batch["cross_arm"] == {"among-noise": True}


def test_vllm_cpu_ngram_speculation_on_qwen3_next_is_flagged(
    vllm_ready: Path, compat_models: dict[str, Path], tmp_path: Path
) -> None:
    model = str(compat_models["qwen3_next"])
    args = ["--launcher", "vllm", "--model", model, "--dtype", "bfloat16", "--scenario", "spec", "--repeats", "5"]
    args += ["--max-tokens", "24", "--server-arg=--no-enable-prefix-caching", *VLLM_SHAPE[:-2]]
    code, summary = probe(tmp_path / "s", *args)
    assert code == 1
    a = arms(summary)
    assert a["spec-off"]["stable"] and a["spec-off"]["texts_identical"]
    assert not a["spec-on"]["stable"] and not a["spec-on"]["texts_identical"]  # different greedy text run to run


def test_vllm_align_mode_cache_hits_match_the_predictor(
    vllm_ready: Path, compat_models: dict[str, Path], tmp_path: Path
) -> None:
    """vLLM picks 288-token blocks for this hybrid (attention page >= mamba page); no speculation with
    prefix caching on CPU. The predictor's rule code must reproduce vLLM's hybrid cache hits exactly."""
    from kvwarden.probe.predict import predict_pair

    model = str(compat_models["qwen3_next"])
    args = ["--launcher", "vllm", "--model", model, "--dtype", "bfloat16", "--scenario", "contamination"]
    args += ["--a-len", "720", "--b-len", "1000", "--shared", "620", "--repeats", "3"]
    code, summary = probe(tmp_path / "c", *args)
    a = arms(summary)
    pred = predict_pair("vllm-align", 288, 720, 1000, 620, max_num_batched_tokens=2048, repeats=3)
    assert a["clean"]["cached_tokens"] == pred.clean_cached_tokens == [0, 864, 864]
    assert a["contaminated"]["cached_tokens"] == pred.b_cached_tokens == [576, 864, 864]
    assert a["no-cache"]["cached_tokens"] == [0, 0, 0]
    # Measured here: vLLM's CPU kernels give the same bits although B's cached KV came from A's
    # chunk (the predictor, which assumes chunk-shape-dependent kernels, says "history-dependent").
    assert code == 0 and summary["cross_arm"] == {"contaminated": True}
    assert pred.history_dependent and pred.repeats_stable
