"""The disaggregated abort race at scale: corruptions with and without the abort handshake.

Starts a single server (the cold reference), a prefill instance whose KV
transfers are spread over ``--transfer-delay-ms`` (so aborts land before,
during and after them) and, per mode, a fresh decode instance with a small
KV pool (freed blocks are reused at once): ``handshake`` (the default
behaviour) and ``unsafe`` (``--unsafe-pd-abort``: blocks freed at once, the
race of production engines). Each mode sends ``--requests`` completions, a
share abandoned by the client at random moments; every completed answer is
compared with the single server's by its top-20 logprob fingerprint.

    kvwarden bench pd_faults                       # 1,000 requests per mode on llama-tiny (~5 min on 2 cores)
    kvwarden bench pd_faults --requests 200 --modes unsafe

Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from functools import partial
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.progress import Progress

from kvwarden.bench.pd_campaign import CampaignConfig, references, run_campaign
from kvwarden.probe.launchers import KvwardenLauncher, RunningServer, ServerSettings


def start(model: str, label: str, run_dir: Path, *args: str) -> RunningServer:
    settings = ServerSettings(device="cpu", extra_args=("--disable-log-requests", *args))
    return KvwardenLauncher().start(model, settings, run_dir, label)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="builtin:llama-tiny")
    p.add_argument("--requests", type=int, default=1000, help="completions per mode")
    p.add_argument("--modes", default="handshake,unsafe", help="comma-separated: handshake, unsafe")
    p.add_argument("--transfer-delay-ms", type=float, default=150.0, help="each transfer spread over this long")
    p.add_argument("--num-blocks", type=int, default=48, help="the decode instance's KV pool (small: fast reuse)")
    p.add_argument("--concurrency", type=int, default=12)
    p.add_argument("--abort-share", type=float, default=0.5)
    p.add_argument("--abort-window", type=float, default=0.4, help="seconds: an abandoned request is cut in [0, this]")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    modes = [m for m in args.modes.split(",") if m]
    if bad := [m for m in modes if m not in ("handshake", "unsafe")]:
        p.error(f"--modes: unknown mode {bad[0]!r} (handshake, unsafe)")
    cfg = CampaignConfig(
        requests=args.requests,
        concurrency=args.concurrency,
        abort_share=args.abort_share,
        abort_window_s=args.abort_window,
        seed=args.seed,
    )
    console = Console(stderr=True)
    run_dir = Path(tempfile.mkdtemp(prefix="kvwarden-pd-faults-"))
    rows: dict[str, dict[str, Any]] = {}
    servers: list[RunningServer] = []
    try:
        servers.append(single := start(args.model, "single", run_dir))
        delay = f"transfer-delay={args.transfer_delay_ms}"
        servers.append(prefill := start(args.model, "prefill", run_dir, "--role", "prefill", "--inject-fault", delay))
        refs = asyncio.run(references(single.url, args.model, cfg))
        for mode in modes:
            extra = ["--role", "decode", "--num-blocks", str(args.num_blocks)]
            extra += ["--unsafe-pd-abort"] if mode == "unsafe" else []
            decode = start(args.model, f"decode-{mode}", run_dir, *extra)
            servers.append(decode)
            with Progress(console=console, transient=True) as bar:
                task = bar.add_task(f"{mode}: {cfg.requests} requests", total=cfg.requests)
                advance = partial(bar.advance, task)
                result = asyncio.run(run_campaign(decode.url, prefill.url, args.model, refs, cfg, advance))
            decode.stop()
            rows[mode] = result.summary()
            if result.errors:
                console.print(f"[{mode}] first errors: {result.errors}")
            if not result.pools_at_baseline:
                keys = ("num_blocks", "free_blocks", "running", "waiting", "remote_waiting", "detached_blocks")
                for name, st in (("decode", result.decode), ("prefill", result.prefill)):
                    print(f"[{mode}] {name} not back at baseline: { ({k: st.get(k) for k in keys}) }", file=sys.stderr)
            if result.corruptions:
                console.print(f"[{mode}] first corrupted answers: {result.corruptions}")
    finally:
        for server in servers:
            server.stop()
    print_table(rows, args)
    print(json.dumps({"bench": "pd_faults", "model": args.model, "transfer_delay_ms": args.transfer_delay_ms,
                      "num_blocks": args.num_blocks, "modes": rows}))  # fmt: skip


def print_table(rows: dict[str, dict[str, Any]], args: argparse.Namespace) -> None:
    print(f"\n{args.model}, transfers spread over {args.transfer_delay_ms:g} ms, decode pool {args.num_blocks} blocks")
    print("| mode | sent | completed | abandoned | failed | corrupted | aborts before / during / after | pools back |")
    print("|---|---|---|---|---|---|---|---|")
    for mode, r in rows.items():
        stages = f"{r['decode_aborts_before']} / {r['decode_aborts_during']} / {r['decode_aborts_after']}"
        print(f"| {mode} | {r['sent']} | {r['completed']} | {r['abandoned']} | {r['failed']} | {r['corrupted']} | "
              f"{stages} | {r['pools_at_baseline']} |")  # fmt: skip
    sys.stdout.flush()


if __name__ == "__main__":
    main()
