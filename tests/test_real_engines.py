"""The probe against engines nobody here wrote: llama.cpp's llama-server and vLLM's CPU build.

Installed by ``scripts/build_llama_server.sh`` and ``scripts/install_vllm.sh``
(``make test`` runs both first); a missing engine is a failure, not a skip.

What is asserted is kvwarden's contract, whatever the engine does: the probe
starts the server, collects every arm, reports fingerprints, verdicts and an
exit status that follow from its raw records (``probe_contract.check_run``),
learns the block size the server really uses, and the predictor's cached-token
counts equal the engine's for that block size. Whether an engine is stable on
this CPU, which block size it picked and how many tokens it cached are
measurements: recorded with ``measure`` (printed at the end of the run and
written to ``runs/real-engines/``), never asserted - they differ between
machines of the same kind. A server that dies under a request is an arm error
the probe must report (exit status 2), not a hang.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from safetensors.torch import save_file

from kvwarden import LLM, SamplingParams
from kvwarden.models.make_model import make_model
from kvwarden.models.sources import smollm2_path
from kvwarden.probe.gguf_convert import convert_to_gguf
from kvwarden.probe.launchers import engines_dir
from probe_contract import check_run, check_suite_run, early_deaths

# one worker runs these one after another: each starts a real server that wants both cores and GBs of memory
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("real-engines")]

LLAMA_SERVER = engines_dir() / "llama.cpp" / "build" / "bin" / "llama-server"
VLLM_PYTHON = engines_dir() / "vllm" / "bin" / "python"
RUNS = Path(__file__).resolve().parent.parent / "runs" / "real-engines"
FA_OFF = ["--server-arg=-fa", "--server-arg=off", "--server-arg=-np", "--server-arg=1"]
SHAPE = ["--a-len", "300", "--b-len", "420", "--shared", "260"]
Measure = Callable[..., None]


def probe(name: str, *args: str) -> tuple[int, dict, Path]:
    """Run ``kvwarden probe`` into ``runs/real-engines/NAME`` (kept for inspection after the run)."""
    out = RUNS / name
    shutil.rmtree(out, ignore_errors=True)  # a leftover run would be resumed, not re-measured
    cmd = [sys.executable, "-m", "kvwarden.cli", "probe", "--no-progress", "--json", "--out", str(out), *args]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=1800)
    crashed = f"probe crashed ({done.returncode}):\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.returncode in (0, 1, 2), crashed
    summary = json.loads(done.stdout.strip().splitlines()[-1])
    return done.returncode, summary, out


def checked(measure: Measure, name: str, *args: str) -> tuple[dict[str, Any], dict[str, dict[str, Any]]]:
    """Probe, check the contract against the raw records, record what the engine did."""
    code, summary, out = probe(name, *args)
    facts = check_run(out, code, summary)
    report_early_deaths(measure, name, out)
    servers = {a["arm"]: a.get("server", {}) for a in summary["arms"]}
    info = next((s for s in servers.values() if s), {})
    extra = {"block_size": info.get("block_size"), "block_size_source": info.get("block_size_source")}
    measure(name, exit_status=code, arms=facts, **{k: v for k, v in extra.items() if v is not None}, run_dir=out)
    return summary, facts


def report_early_deaths(measure: Measure, name: str, out: Path) -> None:
    """A server that died before its first answer measured nothing: recorded as a crash, which the run's
    summary prints in its own loud section with the server's last log lines (``conftest.py``)."""
    for death in early_deaths(out):
        measure(f"{name}: {death['arm']}", crashed_before_first_answer=True, **death)


def check_prediction(summary: dict[str, Any], measure: Measure, name: str) -> None:
    """The predictor's cached tokens equal the engine's, for the block size the server reported."""
    if any(a["error"] for a in summary["arms"]):
        return  # the engine died: check_run already held the probe to reporting it (exit status 2)
    pred = summary["prediction"]
    assert "skipped" not in pred, pred
    assert pred["block_size_source"] in ("log", "metrics"), f"block size not discovered from the server: {pred}"
    measure(
        f"{name}: prediction",
        rule=pred["rule"],
        block_size=pred["block_size"],
        predicted_history_dependent=pred["predicted_history_dependent"],
    )
    assert pred["matches"], f"predicted {pred['predicted']}, observed {pred['observed']} ({pred['explanation']})"


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


@pytest.mark.parametrize("settings", ["default", "fa-off-one-slot"])
def test_llama_cpp_on_smollm2_is_measured(llama_server: Path, settings: str, measure: Measure) -> None:
    """Default settings (4 slots, flash attention auto) and ``-fa off -np 1``: repeat, contamination, batch."""
    model = str(smollm2_path())
    extra = FA_OFF if settings == "fa-off-one-slot" else []
    for scenario in ("repeat", "contamination", "batch"):
        args = ["--launcher", "llama.cpp", "--model", model, "--scenario", scenario, *SHAPE, *extra]
        summary, _ = checked(measure, f"llama.cpp-smollm2-{settings}-{scenario}", *args)
        assert summary["prediction"] == {"skipped": summary["prediction"]["skipped"]}  # no block model for llama.cpp
        for arm in summary["arms"]:
            assert arm["error"] or arm["server"]["extra"]["total_slots"] >= 1, arm  # the launcher asked /props
        first = summary["arms"][0]
        # A server that crashed (llama-server has exited with SIGSEGV here under -fa off -np 1) is a
        # measurement, recorded above; only a server that answered can show whether -np 1 reached it.
        if settings == "fa-off-one-slot" and not first["error"]:
            assert first["server"]["extra"]["total_slots"] == 1  # -np 1 reached the server


def test_llama_cpp_on_our_float32_llama_is_measured(converted_llama: tuple[Path, Path], measure: Measure) -> None:
    _, gguf = converted_llama
    args = ["--launcher", "llama.cpp", "--model", str(gguf), "--scenario", "contamination", *SHAPE, *FA_OFF]
    checked(measure, "llama.cpp-llama-small-f32-fa-off-contamination", *args)


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


def test_vllm_cpu_dense_cache_hits_match_the_predictor(
    vllm_ready: Path, compat_models: dict[str, Path], measure: Measure
) -> None:
    model = str(compat_models["llama"])
    args = ["--launcher", "vllm", "--model", model, "--scenario", "contamination", *VLLM_SHAPE]
    summary, _ = checked(measure, "vllm-llama-small-contamination", *args)
    check_prediction(summary, measure, "vllm-llama-small-contamination")
    if "skipped" not in summary["prediction"]:
        assert summary["prediction"]["rule"] == "vllm"  # a dense model: plain chunked prefill


def test_vllm_cpu_ngram_speculation_on_qwen3_next_is_measured(
    vllm_ready: Path, compat_models: dict[str, Path], measure: Measure
) -> None:
    model = str(compat_models["qwen3_next"])
    args = ["--launcher", "vllm", "--model", model, "--dtype", "bfloat16", "--scenario", "spec", "--repeats", "3"]
    args += ["--max-tokens", "24", "--server-arg=--no-enable-prefix-caching", *VLLM_SHAPE[:-2]]
    checked(measure, "vllm-qwen3-next-ngram-spec", *args)


def test_vllm_align_mode_cache_hits_match_the_predictor_for_the_block_size_vllm_chose(
    vllm_ready: Path, compat_models: dict[str, Path], measure: Measure
) -> None:
    """vLLM raises a hybrid's block size until an attention page holds a mamba page; the value it
    picks differs between machines (160 here, 288 on another CPU). The probe must read it from the
    server, and the predictor's rule code must then reproduce vLLM's hybrid cache hits exactly."""
    model = str(compat_models["qwen3_next"])
    args = ["--launcher", "vllm", "--model", model, "--dtype", "bfloat16", "--scenario", "contamination"]
    args += ["--block-size", "32", "--a-len", "720", "--b-len", "1000", "--shared", "620", "--repeats", "2"]
    summary, _ = checked(measure, "vllm-qwen3-next-align-contamination", *args)
    check_prediction(summary, measure, "vllm-qwen3-next-align-contamination")
    if "skipped" not in summary["prediction"]:
        assert summary["prediction"]["rule"] == "vllm-align"
        assert summary["prediction"]["observed"]["no-cache"] == [0, 0]


def test_the_guard_in_front_of_vllm_cpu_uses_the_repetition_and_garbage_monitors(
    vllm_ready: Path, compat_models: dict[str, Path], measure: Measure, tmp_path: Path
) -> None:
    """vLLM reports no per-request acceptance: the guard adds logprobs itself and watches loops and garbage."""
    import httpx
    import openai

    from kvwarden.probe.launchers import ServerSettings, VllmLauncher
    from server_util import running_guard

    vllm = VllmLauncher().start(str(compat_models["llama"]), ServerSettings(), tmp_path, "vllm-guard")
    config = tmp_path / "guard.toml"
    # Both windows 64 tokens: a loop of one token (also very unlikely) is reported as the loop it is.
    config.write_text("max_retries = 1\n[monitors.garbage]\nwindow = 64\n[canary]\ninterval = 0.0\n")
    try:
        model = httpx.get(f"{vllm.url}/v1/models", timeout=10).json()["data"][0]["id"]
        with running_guard([vllm.url], "--config", str(config)) as guard:
            body = {"model": model, "prompt": "The report on the budget was filed on", "max_tokens": 100}
            body["extra_body"] = {"ignore_eos": True}
            via = openai.OpenAI(base_url=f"{guard.url}/v1", api_key="none", max_retries=0, timeout=300)
            direct = openai.OpenAI(base_url=f"{vllm.url}/v1", api_key="none", max_retries=0, timeout=300)
            got = via.completions.create(temperature=0.0, **body)
            want = direct.completions.create(temperature=0.0, logprobs=0, **body)
            assert got.choices[0].text == want.choices[0].text and got.choices[0].logprobs is None
            chosen = want.choices[0].logprobs.token_logprobs
            facts: dict[str, Any] = {"greedy_mean_logprob": sum(chosen) / len(chosen)}
            # Garbage: sampling far from the model's choices; a loop: one token forced by logit_bias.
            for reason, extra in (
                ("garbage", {"temperature": 2.0, "seed": 1}),
                ("repetition", {"logit_bias": {"100": 100}}),
            ):
                with pytest.raises(openai.APIStatusError) as err:
                    via.completions.create(**{"temperature": 0.0, **body, **extra})
                assert err.value.status_code == 502
                assert err.value.response.json()["error"]["code"] == reason, err.value.response.text
            metrics = guard.metrics()
            for reason in ("garbage", "repetition"):
                facts[f"aborts_{reason}"] = metrics[f'kvwarden_guard:aborts_total{{reason="{reason}"}}']
                assert facts[f"aborts_{reason}"] == 2  # the first attempt and its one retry
        text = httpx.get(f"{vllm.url}/metrics", timeout=10).text
        gauges = {
            line.split("{")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith(("vllm:num_requests_running", "vllm:kv_cache_usage_perc"))
        }
        facts.update(gauges)
        measure("guard-in-front-of-vllm", **facts)
        # The aborted requests were dropped by vLLM when the guard closed their connections.
        assert gauges["vllm:num_requests_running"] == 0 and gauges["vllm:kv_cache_usage_perc"] == 0
    finally:
        vllm.stop()


# The built-in invoice suite, cut to fit CI (2 runs per task, 3 arms; 35 s of requests per engine): kvwarden on
# its first 2 tasks, vLLM on its first 3 with answers cut at 32 tokens (the full suite's figures: docs/probe.md).
SUITE = ["--suite", "invoices-50", "--repeats", "2"]


def suite_checked(measure: Measure, name: str, *args: str) -> dict[str, dict[str, Any]]:
    """Run a suite, check the probe's contract against its records, record what the engine did."""
    code, brief, out = probe(name, *args)
    facts = check_suite_run(out, code, brief)
    report_early_deaths(measure, name, out)
    measure(name, exit_status=code, **{arm: f for arm, f in facts.items()}, run_dir=out)
    return facts


@pytest.fixture(scope="module")
def smollm2_hf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """SmolLM2-135M in Hugging Face format for vLLM: the GGUF's weights, dequantized by transformers."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = smollm2_path()
    out = tmp_path_factory.mktemp("smollm2-hf")
    AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name).save_pretrained(out)
    model = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name, dtype=torch.float32)
    # transformers will not save_pretrained a model it loaded from GGUF: write the dequantized weights and a
    # plain config (no quantization_config) by hand.
    config = model.config.to_dict()
    config.pop("quantization_config", None)
    (out / "config.json").write_text(json.dumps(config, indent=2))
    weights = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    if config.get("tie_word_embeddings"):
        weights.pop("lm_head.weight", None)  # tied: one tensor, stored once
    save_file(weights, str(out / "model.safetensors"))
    return out


def test_the_invoice_suite_on_smollm2_in_kvwarden_and_vllm_cpu(
    vllm_ready: Path, smollm2_hf: Path, measure: Measure
) -> None:
    """Real weights, answers under a JSON schema: accuracy, answer agreement and logit stability per arm.
    kvwarden's logits are stable in every arm (its contract); vLLM's are a measurement."""
    args = ["--launcher", "kvwarden", "--model", "smollm2", "--tasks", "2", *SUITE]
    facts = suite_checked(measure, "suite-kvwarden-smollm2", *args)
    assert all(f.get("logits_stable") == f.get("tasks") for f in facts.values()), facts
    args = ["--launcher", "vllm", "--model", str(smollm2_hf), "--block-size", "32", "--tasks", "3", *SUITE]
    args += ["--max-tokens", "32"]
    suite_checked(measure, "suite-vllm-cpu-smollm2", *args)


def test_the_invoice_suite_on_llama_cpp_sends_the_schema_its_own_way(llama_server: Path, measure: Measure) -> None:
    """llama-server reads the answer schema from its own ``json_schema`` field (the probe's default with this
    launcher) and ignores ``cache_salt``, so its clean arm shares blocks like the contaminated one."""
    args = ["--launcher", "llama.cpp", "--model", "smollm2", "--tasks", "3", *SUITE]
    suite_checked(measure, "suite-llama.cpp-smollm2", *args)
