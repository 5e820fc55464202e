"""``kvwarden generate``: one-off generation from the command line."""

from __future__ import annotations

import argparse
import json

from kvwarden.cli import add_engine_args, engine_kwargs
from kvwarden.engine.sampling_params import SamplingParams


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("generate", help="generate for prompts given on the command line")
    add_engine_args(p)
    p.add_argument("--prompt", action="append", required=True, help="a prompt (repeat for a batch)")
    p.add_argument(
        "--chat",
        action="store_true",
        help="wrap each prompt as a user message in the chat template",
    )
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--sampling-seed", type=int, default=None)
    p.add_argument("--logprobs", type=int, default=None)
    p.add_argument("--json", action="store_true", help="one JSON object per output")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from kvwarden.llm import LLM

    params = SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        logprobs=args.logprobs,
    )
    llm = LLM(args.model, **engine_kwargs(args))
    prompts = args.prompt
    if args.chat:
        prompts = [llm.tokenizer.apply_chat_template([{"role": "user", "content": p}]) for p in prompts]
    for out in llm.generate(prompts, params):
        if args.json:
            print(
                json.dumps(
                    {
                        "text": out.text,
                        "token_ids": out.token_ids,
                        "logprobs": out.logprobs,
                        "num_cached_tokens": out.num_cached_tokens,
                        "finish_reason": out.finish_reason,
                    }
                )
            )
        else:
            print(out.text)
    return 0
