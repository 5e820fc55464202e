"""Train a written checkpoint briefly on the bundled text (``make-model --train-steps``).

A random-weight target is chaotic: its next token depends on its whole context in
no learnable way, so any drafter (MTP head, draft model, n-gram) accepts ~10 % of
its drafts and speculative decoding cannot pay. A few hundred steps of next-token
training on the bundled text give the target continuations that follow the text's
regularities; a drafter fitted afterwards (``--fit-mtp``) then accepts what a real
model's would. The trained model is still a toy: its point is acceptance, not quality.

Training runs through transformers' own implementation of the family (the model
kvwarden agrees with), in float32, on the CPU or a GPU; the weights are written back
into the checkpoint in their stored dtype under their stored names. Tensors the
transformers model does not own (``mtp.*``) are kept byte for byte.
"""

from __future__ import annotations

import math
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from kvwarden.models.bundled import corpus_text, documents
from kvwarden.models.config import ModelConfig
from kvwarden.models.loader import is_mtp_tensor

Progress = Callable[[str], None] | None
SEQ_LEN, BATCH = 128, 16  # 2K tokens a step: ~0.5 s on 2 CPU cores for a tiny preset; small ones want a GPU
HELDOUT = 0.1  # the text's last tenth is held out: its loss says whether training generalised


def bundled_token_ids(model_dir: Path) -> torch.Tensor:
    """The bundled text (corpus, then the documents) in the checkpoint's own tokenizer, as one id tensor."""
    import transformers

    tok = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    tok.model_max_length = 1 << 30  # the whole text is tokenized once and cut into windows: no overflow warning
    text = corpus_text() + "\n\n" + "\n\n".join(d.text for d in documents())
    return torch.tensor(tok(text)["input_ids"], dtype=torch.long)


def _heldout_loss(model: torch.nn.Module, ids: torch.Tensor, device: torch.device) -> float:
    """Mean next-token loss (nats) over whole SEQ_LEN windows of the held-out text."""
    windows = ids[: len(ids) // SEQ_LEN * SEQ_LEN].view(-1, SEQ_LEN)
    model.eval()
    with torch.no_grad():
        losses = [model(input_ids=w.to(device), labels=w.to(device)).loss.item() for w in windows.split(BATCH)]
    model.train()
    return sum(losses) / len(losses)


def train_preset(
    model_dir: Path,
    steps: int,
    seed: int = 0,
    device: str = "cpu",
    lr: float = 3e-3,
    progress: Progress = None,
) -> dict[str, float]:
    """Train ``model_dir``'s weights for ``steps`` AdamW steps and write them back in place.

    Args:
        model_dir: a checkpoint written by ``make-model`` (or any transformers-loadable one).
        steps: optimizer steps of ``BATCH`` windows of ``SEQ_LEN`` tokens.
        seed: picks the windows (an explicit generator: the same seed gives the same weights on one machine).
        device: ``cpu`` or ``cuda``.
        lr: peak learning rate (linear warm-up over a tenth of the steps, then cosine to zero).

    Returns:
        ``initial_heldout_loss`` and ``heldout_loss`` (nats per token), ``train_loss`` (last step),
        ``steps``, ``tokens`` (seen), ``seconds``.

    Raises:
        ValueError: ``steps`` < 1, or the text is shorter than two windows.
    """
    import transformers

    if steps < 1:
        raise ValueError(f"--train-steps: must be >= 1, got {steps}")
    model_dir, start, dev = Path(model_dir), time.perf_counter(), torch.device(device)
    ids = bundled_token_ids(model_dir)
    split = int(len(ids) * (1 - HELDOUT))
    train_ids, heldout_ids = ids[:split], ids[split:]
    if len(heldout_ids) < SEQ_LEN or len(train_ids) < 2 * SEQ_LEN:
        raise ValueError(f"the bundled text is too short for {SEQ_LEN}-token windows ({len(ids)} tokens)")
    torch.manual_seed(seed)  # dropout is off in every family we build; this only pins anything else
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32).to(dev).train()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01, betas=(0.9, 0.95))
    warmup = max(1, steps // 10)

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        return 0.5 * (1 + math.cos(math.pi * (step - warmup) / max(1, steps - warmup)))

    sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
    initial = _heldout_loss(model, heldout_ids, dev)
    _say(progress, f"[train] {len(ids)} tokens ({split} train); held-out loss before {initial:.3f}; {steps} steps")
    loss = torch.tensor(float("nan"))
    for step in range(1, steps + 1):
        starts = torch.randint(0, len(train_ids) - SEQ_LEN, (BATCH,), generator=gen)
        batch = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()]).to(dev)
        loss = model(input_ids=batch, labels=batch).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if step % max(1, steps // 10) == 0 or step == steps:
            _say(progress, f"[train] step {step}/{steps} loss {loss.item():.3f} ({time.perf_counter() - start:.0f} s)")
    final = _heldout_loss(model, heldout_ids, dev)
    _write_back(model, model_dir)
    return {
        "initial_heldout_loss": initial,
        "heldout_loss": final,
        "train_loss": loss.item(),
        "steps": steps,
        "tokens": steps * BATCH * SEQ_LEN,
        "seconds": time.perf_counter() - start,
    }


def _write_back(model: torch.nn.Module, model_dir: Path) -> None:
    """Replace the checkpoint's tensors by the trained ones, in their stored dtype and names.

    transformers' ``save_pretrained`` undoes its load-time conversions (fused experts go back to
    one tensor per expert), so its names are the checkpoint's; a stored tensor the model did not
    write (other than the MTP head's, which transformers does not build) means the mapping broke.
    """
    config = ModelConfig.from_dir(model_dir)
    with tempfile.TemporaryDirectory() as tmp:
        model.to("cpu").save_pretrained(tmp, safe_serialization=True)
        trained = {k: v for f in sorted(Path(tmp).glob("*.safetensors")) for k, v in load_file(str(f)).items()}
    updated, missing = [], []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), "pt") as handle:
            metadata = handle.metadata()
        tensors = load_file(str(f))
        for name, stored in tensors.items():
            if name in trained:
                tensors[name] = trained[name].to(stored.dtype).contiguous()
            elif not is_mtp_tensor(config, name):  # the MTP head: transformers does not build it
                missing.append(name)
        updated.append((f, tensors, metadata))
    if missing:  # checked before any file is rewritten: a broken mapping leaves the checkpoint as it was
        raise RuntimeError(f"training did not produce {len(missing)} stored tensors, e.g. {missing[:3]}")
    for f, tensors, metadata in updated:
        save_file(tensors, str(f), metadata=metadata)


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)
