"""Tokenizer: a ``tokenizers`` backend plus the model's chat template.

Loaded from a Hugging Face directory (``tokenizer.json`` + ``tokenizer_config.json``)
or rebuilt from a GGUF file's metadata (byte-level BPE).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jinja2
import jinja2.sandbox
from tokenizers import Tokenizer as Backend
from tokenizers import decoders, models, pre_tokenizers

Message = dict[str, Any]


class Tokenizer:
    """Encode/decode text and render chat prompts.

    Attributes:
        eos_token_ids: ids that end generation by default.
        bos_token_id: id prepended to prompts when ``add_bos`` is set.
    """

    def __init__(
        self,
        backend: Backend,
        chat_template: str | None,
        eos_token_ids: tuple[int, ...],
        bos_token_id: int | None = None,
        add_bos: bool = False,
        special_tokens: dict[str, str] | None = None,
    ) -> None:
        self.backend = backend
        self.chat_template = chat_template
        self.eos_token_ids = eos_token_ids
        self.bos_token_id = bos_token_id
        self.add_bos = add_bos
        self.special_tokens = special_tokens or {}
        self._template: jinja2.Template | None = None
        self.local_decode = _local_decoder(backend)

    @property
    def vocab_size(self) -> int:
        return self.backend.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``; ``add_special_tokens`` adds the BOS token where the model wants one."""
        ids = self.backend.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos and self.bos_token_id is not None:
            ids = [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self.backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def id_to_token(self, token_id: int) -> str | None:
        return self.backend.id_to_token(token_id)

    def apply_chat_template(
        self,
        messages: list[Message],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        extra: dict[str, Any] | None = None,
    ) -> str:
        """Render ``messages`` with the model's chat template (``tools``: the OpenAI tool definitions, as
        transformers passes them; ``extra``: more template variables, e.g. ``enable_thinking``).

        Raises:
            ValueError: the model has no chat template, or rendering failed.
        """
        if not self.chat_template:
            raise ValueError("this model has no chat template; use completions with a plain prompt")
        if self._template is None:
            env = jinja2.sandbox.ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
            env.globals["raise_exception"] = _raise_template_error
            self._template = env.from_string(self.chat_template)
        try:
            return self._template.render(
                messages=messages,
                add_generation_prompt=add_generation_prompt,
                **({"tools": tools} if tools else {}),
                **(extra or {}),
                **self.special_tokens,
            )
        except jinja2.TemplateError as exc:
            raise ValueError(f"chat template failed: {exc}") from exc

    @classmethod
    def from_dir(cls, model_dir: str | Path, eos_token_ids: tuple[int, ...] = ()) -> Tokenizer:
        """Load ``tokenizer.json`` (+ ``tokenizer_config.json``) from a model directory."""
        path = Path(model_dir)
        tok_file = path / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model directory")
        backend = Backend.from_file(str(tok_file))
        cfg: dict[str, Any] = {}
        cfg_file = path / "tokenizer_config.json"
        if cfg_file.is_file():
            cfg = json.loads(cfg_file.read_text())
        template = cfg.get("chat_template")
        template_file = path / "chat_template.jinja"
        if template is None and template_file.is_file():
            template = template_file.read_text()
        special = {k: _token_text(cfg.get(k)) for k in ("bos_token", "eos_token") if cfg.get(k)}
        eos = tuple(eos_token_ids)
        eos_text = special.get("eos_token")
        if not eos and eos_text is not None and backend.token_to_id(eos_text) is not None:
            eos = (backend.token_to_id(eos_text),)
        bos_text = special.get("bos_token")
        bos = backend.token_to_id(bos_text) if bos_text else None
        return cls(backend, template, eos, bos, bool(cfg.get("add_bos_token", False)), special)

    @classmethod
    def from_gguf_fields(cls, fields: dict[str, Any]) -> Tokenizer:
        """Rebuild a byte-level BPE tokenizer from GGUF ``tokenizer.ggml.*`` metadata."""
        if fields.get("tokenizer.ggml.model") != "gpt2":
            raise ValueError(
                f"gguf: tokenizer model {fields.get('tokenizer.ggml.model')!r} is not supported (gpt2 only)"
            )
        tokens: list[str] = fields["tokenizer.ggml.tokens"]
        vocab = {tok: i for i, tok in enumerate(tokens)}
        merges = [tuple(m.split(" ", 1)) for m in fields["tokenizer.ggml.merges"]]
        backend = Backend(models.BPE(vocab=vocab, merges=merges, fuse_unk=False))
        pre = fields.get("tokenizer.ggml.pre", "gpt-2")
        # llama.cpp's "smollm" pre-tokenizer isolates every digit before the GPT-2 split.
        steps = [pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)]
        if pre == "smollm":
            steps.insert(0, pre_tokenizers.Digits(individual_digits=True))
        backend.pre_tokenizer = pre_tokenizers.Sequence(steps)
        backend.decoder = decoders.ByteLevel()
        types: list[int] = fields.get("tokenizer.ggml.token_type", [])
        control = [tokens[i] for i, t in enumerate(types) if t == 3]  # 3 = control token
        backend.add_special_tokens(control)
        eos = fields.get("tokenizer.ggml.eos_token_id")
        bos = fields.get("tokenizer.ggml.bos_token_id")
        special = {}
        if bos is not None:
            special["bos_token"] = tokens[bos]
        if eos is not None:
            special["eos_token"] = tokens[eos]
        eos_ids = {eos} if eos is not None else set()
        # Chat models end a turn with <|im_end|>; treat it as a stop token too.
        if "<|im_end|>" in vocab:
            eos_ids.add(vocab["<|im_end|>"])
        return cls(
            backend,
            fields.get("tokenizer.chat_template"),
            tuple(sorted(eos_ids)),
            bos,
            bool(fields.get("tokenizer.ggml.add_bos_token", False)),
            special,
        )


# Decoders whose text for a window of tokens, taken from a character boundary and compared with the same
# window without its newest tokens, gives what the newest tokens add to the whole decode.
# ByteFallback is not one: a run of byte tokens that turns invalid replaces its earlier, valid bytes too.
_LOCAL_DECODERS = frozenset({"ByteLevel", "Metaspace", "WordPiece", "BPEDecoder", "Replace"})


def _local_decoder(backend: Backend) -> bool:
    """Whether incremental detokenization (``engine/detokenizer.py``) is exact for this tokenizer."""
    if backend.decoder is None:
        return True  # tokens joined by spaces

    def local(spec: dict[str, Any]) -> bool:
        if spec.get("type") == "Sequence":
            return all(local(d) for d in spec.get("decoders", []))
        return spec.get("type") in _LOCAL_DECODERS

    return local(json.loads(backend.decoder.__getstate__()))


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        return value.get("content")
    return value


def _raise_template_error(message: str) -> None:
    raise jinja2.TemplateError(message)
