"""``make-model --train-steps``: a preset trained on the bundled text learns it, stays a valid checkpoint of the
same format, keeps what transformers does not train (the MTP head), and kvwarden still agrees with transformers.

Scaled down (tens of steps on the tiny presets) to run in well under a minute on 2 cores.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from kvwarden import LLM, SamplingParams
from kvwarden.cli import main as cli_main
from kvwarden.models.make_model import make_model
from kvwarden.models.train_preset import train_preset


def test_training_learns_the_text_and_keeps_the_checkpoint_format(tmp_path: Path) -> None:
    import transformers

    out = make_model("llama", "tiny", 0, tmp_path / "m")
    before = load_file(str(out / "model.safetensors"))
    r = train_preset(out, steps=40, seed=0)
    # A random model's loss is about ln(vocab); forty steps on the text take a clear bite out of it.
    assert r["heldout_loss"] < r["initial_heldout_loss"] - 0.5, r
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    assert all(after[k].dtype == t.dtype and after[k].shape == t.shape for k, t in before.items())
    assert all(not torch.equal(after[k], t) for k, t in before.items() if "norm" not in k), "a weight was not trained"

    # kvwarden's loader reads the trained checkpoint as transformers does: same greedy tokens.
    prompt = list(range(5, 37))
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out), dtype=torch.float32).eval()
    with torch.no_grad():
        ref = hf.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False, eos_token_id=None)
    got = LLM(str(out)).generate([prompt], SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True))
    assert got[0].token_ids == ref[0, len(prompt) :].tolist()


def test_training_leaves_the_mtp_head_for_the_fit(tmp_path: Path) -> None:
    out = make_model("qwen3_next", "tiny", 0, tmp_path / "m")
    before = load_file(str(out / "model.safetensors"))
    train_preset(out, steps=3, seed=0)
    after = load_file(str(out / "model.safetensors"))
    assert after.keys() == before.keys()
    mtp = [k for k in before if k.startswith("mtp.")]
    assert mtp and all(torch.equal(after[k], before[k]) for k in mtp)  # transformers has no MTP head to train
    assert not torch.equal(after["model.embed_tokens.weight"], before["model.embed_tokens.weight"])


@pytest.mark.parametrize(
    ("argv", "flag"),
    [
        (["--arch", "llama", "--train-steps", "0"], "--train-steps"),
        (["--arch", "llama", "--device", "cuda"], "--device"),
        (["--config", "bench/configs/smollm2-135m.json", "--train-steps", "5"], "--train-steps"),
    ],
)
def test_make_model_training_flags_are_checked_before_writing(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], flag: str
) -> None:
    config_argv = [str(Path(__file__).resolve().parent.parent / a) if a.startswith("bench/") else a for a in argv]
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["make-model", *config_argv, "--out", str(tmp_path / "x")])
    assert exit_info.value.code == 2
    assert flag in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
