"""Fit speculative-decoding drafters to a target model's own greedy output.

A random MTP head or draft model almost never agrees with the target, so
speculation over it accepts nothing. :func:`fit_mtp` (the ``mtp.*`` head, in
place, as :mod:`kvwarden.models.mtp` runs it) and :func:`fit_draft_model` (a
small Llama sharing the tokenizer) distill on the target's greedy
continuations of the bundled text, with the target's argmax as the label: the
held-out accuracy is the expected acceptance of the first draft token under
greedy decoding.
"""

from __future__ import annotations

import copy
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn

from kvwarden.models.train_preset import bundled_token_ids

Progress = Callable[[str], None] | None
PROMPT_LEN, NEW_TOKENS = 32, 64
# Data, not steps, limits held-out accuracy: a random target's next token depends on its whole context,
# so with fewer continuations either drafter memorises the training rows. The default step counts are
# where held-out accuracy stops rising on the tiny preset (the draft model overfits past it).
NUM_PROMPTS = 512
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json")
EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}  # fused [gate; up]


@dataclass
class Distillation:
    """Prompt + greedy continuation of the target, with what the target computes over it."""

    tokens: torch.Tensor  # [n, T] prompt then continuation
    labels: torch.Tensor  # [n, T] the target's argmax at each position (its prediction for p + 1)
    hidden: torch.Tensor  # [n, T, hidden] the target's last hidden state, after its final norm
    embed: torch.Tensor  # [vocab, hidden] frozen, shared with the MTP head
    lm_head: torch.Tensor  # [vocab, hidden] frozen, shared with the MTP head
    config: Any  # the target's transformers config
    num_train: int  # rows [:num_train] train, the rest are held out


def _say(progress: Progress, msg: str) -> None:
    if progress is not None:
        progress(msg)


def distillation_data(
    model_dir: Path,
    seed: int = 0,
    num_prompts: int = NUM_PROMPTS,
    progress: Progress = None,
    tag: str = "fit",
    device: str = "cpu",
) -> Distillation:
    """Greedy continuations of bundled-text windows by the target, plus its labels and hidden states.

    One in eight prompts is held out; those come from the last part of the text only,
    so no held-out prompt overlaps a training one. ``device`` runs the target (the costly
    part); what is returned lives on the CPU, where the drafters are fitted.
    """
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir), dtype=torch.float32)
    model = model.to(device).eval()
    ids = bundled_token_ids(model_dir)
    gen = torch.Generator().manual_seed(seed)
    split, num_train = int(len(ids) * 0.85), num_prompts - max(1, num_prompts // 8)
    train = torch.randint(0, split - PROMPT_LEN, (num_train,), generator=gen).tolist()
    heldout = torch.randint(split, len(ids) - PROMPT_LEN, (num_prompts - num_train,), generator=gen).tolist()
    prompts = torch.stack([ids[s : s + PROMPT_LEN] for s in train + heldout])
    _say(progress, f"[{tag}] generating {len(prompts)} greedy continuations of {NEW_TOKENS} tokens")
    pad = model.config.pad_token_id if model.config.pad_token_id is not None else int(ids[0])
    # Equal-length prompts need no padding; min_new_tokens keeps every row the same length (an EOS
    # would otherwise end a row early), and the labels come from the target's real argmax anyway.
    greedy = {"max_new_tokens": NEW_TOKENS, "min_new_tokens": NEW_TOKENS, "do_sample": False, "pad_token_id": pad}
    tokens, labels, hidden = [], [], []
    with torch.no_grad():
        for batch in prompts.to(device).split(128):
            seq = model.generate(batch, attention_mask=torch.ones_like(batch), **greedy)
            # One teacher-forced pass gives the labels and the hidden states the runtime feeds the MTP head.
            h = model.model(input_ids=seq).last_hidden_state
            tokens.append(seq.cpu())
            labels.append(torch.cat([model.lm_head(x).argmax(-1) for x in h.split(8)]).cpu())  # bounded memory
            hidden.append(h.cpu())
    embed, lm_head = (
        m.weight.detach().cpu().clone() for m in (model.get_input_embeddings(), model.get_output_embeddings())
    )
    return Distillation(
        torch.cat(tokens), torch.cat(labels), torch.cat(hidden), embed, lm_head, model.config, num_train
    )


def _causal_mask(n: int) -> torch.Tensor:
    # An explicit additive mask: causal under eager and SDPA attention alike.
    return torch.full((n, n), float("-inf")).triu(1)[None, None]


class _MtpHead(nn.Module):
    """Qwen3-Next's MTP head from transformers' own blocks (names as in ``mtp.*``, experts fused)."""

    def __init__(self, config: Any, data: Distillation) -> None:
        from transformers.models.qwen3_next import modeling_qwen3_next as q

        super().__init__()
        cfg = copy.deepcopy(config)
        # Layer 0 of a one-layer config: full attention, sparse FFN whenever the model has experts
        # (kvwarden's MtpHead builds the extra layer the same way).
        cfg.num_hidden_layers, cfg.layer_types, cfg.mlp_only_layers = 1, ["full_attention"], []
        cfg.decoder_sparse_step = 1
        hidden, eps = cfg.hidden_size, cfg.rms_norm_eps
        self.fc = nn.Linear(2 * hidden, hidden, bias=False)
        self.pre_fc_norm_embedding = q.Qwen3NextRMSNorm(hidden, eps)
        self.pre_fc_norm_hidden = q.Qwen3NextRMSNorm(hidden, eps)
        self.layers = nn.ModuleList([q.Qwen3NextDecoderLayer(cfg, 0)])
        self.norm = q.Qwen3NextRMSNorm(hidden, eps)
        self.rotary = q.Qwen3NextRotaryEmbedding(cfg)
        self.embed, self.lm_head = data.embed, data.lm_head  # frozen plain tensors, not parameters

    def forward(self, next_tokens: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """Logits ``[n, T, vocab]``: row ``p`` reads ``h_p`` and ``t_{p+1}`` and predicts ``t_{p+2}``."""
        e = self.pre_fc_norm_embedding(self.embed[next_tokens])
        x = self.fc(torch.cat([e, self.pre_fc_norm_hidden(hidden)], dim=-1))  # embeddings first
        positions = torch.arange(x.shape[1])[None]
        x = self.layers[0](x, position_embeddings=self.rotary(x, positions), attention_mask=_causal_mask(x.shape[1]))
        return self.norm(x) @ self.lm_head.T

    def load_checkpoint(self, w: dict[str, torch.Tensor]) -> None:
        state = {}
        for name, own in self.state_dict().items():
            base, kind = name.rsplit(".", 1)
            if base.endswith("experts"):  # transformers fuses the experts; checkpoints store one tensor each
                parts = EXPERT_PARTS[kind]
                own = torch.stack(
                    [torch.cat([w[f"mtp.{base}.{e}.{p}.weight"] for p in parts]) for e in range(len(own))]
                )
            else:
                own = w[f"mtp.{name}"]
            state[name] = own.float()
        self.load_state_dict(state)

    def checkpoint(self) -> dict[str, torch.Tensor]:
        """The head's tensors under their checkpoint names (``mtp.*``, one tensor per expert)."""
        w = {}
        for name, value in self.state_dict().items():
            base, kind = name.rsplit(".", 1)
            if not base.endswith("experts"):
                w[f"mtp.{name}"] = value
                continue
            for e, fused in enumerate(value):
                for part, t in zip(EXPERT_PARTS[kind], fused.chunk(len(EXPERT_PARTS[kind])), strict=True):
                    w[f"mtp.{base}.{e}.{part}.weight"] = t
        return w


def _names(path: Path) -> list[str]:
    with safe_open(str(path), "pt") as handle:
        return list(handle.keys())


LogitsFn = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def _accuracy(logits_fn: LogitsFn, rows: torch.Tensor, first: int) -> float:
    """Share of positions from ``first`` on where the drafter's argmax is the target's."""
    with torch.no_grad():
        logits, labels = logits_fn(rows)
    return (logits[:, first:].argmax(-1) == labels[:, first:]).float().mean().item()


def _fit(
    model: nn.Module, logits_fn: LogitsFn, data: Distillation, steps: int, seed: int, progress: Progress, tag: str
) -> dict[str, float]:
    """Adam on the cross-entropy to the target's argmax; ``logits_fn(rows)`` gives (logits, labels) per position.

    Accuracy counts only positions whose input token the target generated itself
    (prompt length - 1 on): those are where speculative decoding drafts.
    """
    start, first = time.perf_counter(), data.tokens.shape[1] - NEW_TOKENS - 1
    train, heldout = torch.arange(data.num_train), torch.arange(data.num_train, len(data.tokens))
    model.eval()
    initial = _accuracy(logits_fn, heldout, first)
    _say(progress, f"[{tag}] held-out accuracy before fitting {initial:.3f}; training {steps} steps")
    model.train()
    gen = torch.Generator().manual_seed(seed)
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=3e-3)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, steps)
    for step in range(1, steps + 1):
        logits, labels = logits_fn(torch.randperm(data.num_train, generator=gen)[:32])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten())
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
        if step % max(1, steps // 8) == 0 or step == steps:
            acc = (logits.argmax(-1) == labels).float().mean().item()
            _say(progress, f"[{tag}] step {step}/{steps} loss {loss.item():.3f} acc {acc:.3f}")
    model.eval()
    return {
        "train_accuracy": _accuracy(logits_fn, train, first),
        "heldout_accuracy": _accuracy(logits_fn, heldout, first),
        "initial_heldout_accuracy": initial,
        "steps": steps,
        "seconds": time.perf_counter() - start,
    }


def fit_mtp(
    model_dir: Path, seed: int = 0, steps: int = 300, progress: Progress = None, data: Distillation | None = None
) -> dict[str, float]:
    """Fit the checkpoint's MTP head to the target's greedy continuations and write it back.

    Only ``mtp.*`` tensors change (in their stored dtype); every other tensor is kept
    byte for byte. ``data`` (:func:`distillation_data` of the same directory) saves
    generating the continuations again.

    Returns:
        ``train_accuracy``, ``heldout_accuracy``, ``initial_heldout_accuracy`` (the head
        as stored before), ``steps``, ``seconds``.

    Raises:
        ValueError: the checkpoint has no MTP head.
    """
    model_dir, start = Path(model_dir), time.perf_counter()
    owners = [f for f in sorted(model_dir.glob("*.safetensors")) if any(k.startswith("mtp.") for k in _names(f))]
    if not owners:
        raise ValueError(
            f"--fit-mtp: {model_dir} has no MTP head in Qwen3-Next's layout (mtp.* tensors), the one --fit-mtp "
            "fits (GLM-5 / DeepSeek heads, model.layers.<num_hidden_layers>.*, are not fitted)"
        )
    stored = {k: v for f in owners for k, v in load_file(str(f)).items() if k.startswith("mtp.")}
    torch.manual_seed(seed)
    data = data if data is not None else distillation_data(model_dir, seed, progress=progress, tag="fit-mtp")
    head = _MtpHead(data.config, data)
    head.load_checkpoint(stored)

    def logits_fn(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = head(data.tokens[rows, 1:], data.hidden[rows, :-1])  # row p: h_p and t_{p+1}
        return logits, data.labels[rows, 1:]  # the target's argmax at p + 1, i.e. its token p + 2

    result = _fit(head, logits_fn, data, steps, seed, progress, "fit-mtp")
    fitted = {k: v.detach().to(stored[k].dtype).contiguous() for k, v in head.checkpoint().items()}
    assert fitted.keys() == stored.keys(), sorted(fitted.keys() ^ stored.keys())
    for f in owners:
        with safe_open(str(f), "pt") as handle:
            metadata = handle.metadata()  # safetensors keeps each tensor's bytes as given
        tensors = load_file(str(f))
        tensors.update({k: fitted[k] for k in tensors if k in fitted})
        save_file(tensors, str(f), metadata=metadata)
    return {**result, "seconds": time.perf_counter() - start}


def fit_draft_model(
    target_dir: Path,
    out_dir: Path,
    seed: int = 0,
    steps: int = 150,
    progress: Progress = None,
    data: Distillation | None = None,
) -> dict[str, float]:
    """Distill a small dense Llama draft model for ``target_dir`` into ``out_dir``.

    It has the target's tokenizer files and vocabulary size, as kvwarden requires of
    ``speculative_config={"method": "draft", "model": out_dir}``; ``data`` as in :func:`fit_mtp`.

    Returns:
        The keys of :func:`fit_mtp` (``initial_heldout_accuracy``: the untrained draft).
    """
    import transformers

    target_dir, out_dir, start = Path(target_dir), Path(out_dir), time.perf_counter()
    torch.manual_seed(seed)
    data = data if data is not None else distillation_data(target_dir, seed, progress=progress, tag="fit-draft")
    t = data.config
    # The target's own embedding and LM head (frozen) when the widths allow: the draft then starts from the
    # features the target reads its tokens with, and overfits far less than with its own.
    share = int(t.hidden_size) <= 256
    hidden = int(t.hidden_size) if share else 128
    dims = {"hidden_size": hidden, "intermediate_size": 2 * hidden, "head_dim": hidden // 4, "num_hidden_layers": 2}
    heads = {"num_attention_heads": 4, "num_key_value_heads": 2, "rms_norm_eps": 1e-6, "dtype": "float32"}
    same = {k: getattr(t, k) for k in ("vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id")}
    cfg = transformers.LlamaConfig(**dims, **heads, **same, tie_word_embeddings=t.tie_word_embeddings or not share)
    draft = transformers.LlamaForCausalLM(cfg).float()
    if share:
        for param, value in ((draft.get_input_embeddings().weight, data.embed), (draft.lm_head.weight, data.lm_head)):
            param.data.copy_(value)
            param.requires_grad_(False)

    def logits_fn(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return draft(input_ids=data.tokens[rows]).logits, data.labels[rows]

    result = _fit(draft, logits_fn, data, steps, seed, progress, "fit-draft")
    out_dir.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(out_dir), safe_serialization=True)
    for name in TOKENIZER_FILES:  # the very same tokenizer: kvwarden refuses a draft whose vocabulary differs
        if (target_dir / name).is_file():
            shutil.copyfile(target_dir / name, out_dir / name)
    return {**result, "seconds": time.perf_counter() - start}
