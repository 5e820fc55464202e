"""make-model writes seeded, byte-identical Hugging Face checkpoints that transformers loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvwarden.models.make_model import make_model
from kvwarden.models.tokenizer import Tokenizer

FILES = ("config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json")


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_same_seed_gives_byte_identical_files(tmp_path: Path, arch: str) -> None:
    a = make_model(arch, "tiny", 7, tmp_path / "a")
    b = make_model(arch, "tiny", 7, tmp_path / "b")
    c = make_model(arch, "tiny", 8, tmp_path / "c")
    for name in FILES:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name
    wa, wc = load_file(str(a / "model.safetensors")), load_file(str(c / "model.safetensors"))
    assert wa.keys() == wc.keys()
    assert not torch.equal(wa["model.embed_tokens.weight"], wc["model.embed_tokens.weight"])


def test_cli_make_model_and_flag_errors(tmp_path: Path) -> None:
    out = tmp_path / "m"
    cmd = [sys.executable, "-m", "kvwarden.cli", "make-model", "--arch", "qwen3", "--preset", "tiny", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, check=False)
    assert done.returncode == 0, done.stderr
    assert json.loads((out / "config.json").read_text())["architectures"] == ["Qwen3ForCausalLM"]
    bad = subprocess.run(
        [sys.executable, "-m", "kvwarden.cli", "make-model", "--arch", "gpt9", "--out", str(out)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert bad.returncode == 2
    assert "--arch" in bad.stderr and "gpt9" in bad.stderr


def test_tokenizer_round_trip_and_chat_template(llama_tiny: Path) -> None:
    tok = Tokenizer.from_dir(llama_tiny)
    text = "Invoice 4471, dated 12 March 2024, total 1,284.50 EUR. Café ü!"
    ids = tok.encode(text)
    assert tok.decode(ids) == text
    assert len(ids) < len(text.encode()), "BPE merges should compress the bundled-style text"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert chat == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    assert tok.eos_token_ids, "eos from generation_config.json"


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_transformers_loads_the_checkpoint(tmp_path: Path, arch: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = make_model(arch, "tiny", 1, tmp_path / arch)
    model = AutoModelForCausalLM.from_pretrained(out)
    tok = AutoTokenizer.from_pretrained(out)
    ids = tok("The cache must never change the answer.", return_tensors="pt").input_ids
    assert ids.shape[1] > 3
    assert model(ids).logits.shape == (1, ids.shape[1], model.config.vocab_size)
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert Tokenizer.from_dir(out).apply_chat_template([{"role": "user", "content": "hi"}]) == chat
