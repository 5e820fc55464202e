"""One summary line of a ``kvwarden.bench.scale`` result file (scripts/gpu_check.sh's scale stage)."""

import json
import sys
from pathlib import Path

r = json.loads(Path(sys.argv[1]).read_text())
online = [(o["concurrency"], o["output_tok_s"], o["tpot_ms"]) for o in r["online"]]
inv = "/".join(str(v)[0] for v in r["invariance"].values())
print(r["config"]["layers"], r["weights_load_s"], r["offline_tok_s"], online, inv)
