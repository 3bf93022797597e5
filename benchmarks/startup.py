"""Start-up time: `twostep generate --chat "Hi" --max-tokens 8` from process start to its first
streamed token (the first byte on stdout) and to exit, warm and cold, beside `import torch` alone.

    .venv/bin/python benchmarks/startup.py                 # warm caches, 5 runs
    .venv/bin/python benchmarks/startup.py --cold --runs 1 # empty kernel and tokenizer caches

Warm: the C++ kernels are built and the GGUF's converted tokenizer is cached (one run first makes
sure). Cold: TORCH_EXTENSIONS_DIR and TWOSTEP_CACHE_DIR point at empty folders, so every kernel
compiles and the tokenizer is converted (transformers is imported for it). Medians are printed.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

TWOSTEP = [str(Path(sys.executable).with_name("twostep")), "--log-level", "WARNING", "generate", "--chat", "Hi",
           "--max-tokens", "8"]


def time_to_first_byte(cmd: list[str], env: dict[str, str]) -> tuple[float, float]:
    """(seconds to the first byte on stdout, seconds to exit)."""
    start = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env)
    proc.stdout.read(1)
    first = time.perf_counter() - start
    proc.stdout.read()
    if proc.wait() != 0:
        raise SystemExit(f"{' '.join(cmd)} failed with exit code {proc.returncode}")
    return first, time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=5)
    ap.add_argument("--cold", action="store_true", help="empty kernel and tokenizer caches for each run")
    args = ap.parse_args()
    env = dict(os.environ)
    if not args.cold:
        time_to_first_byte(TWOSTEP, env)            # builds and caches whatever is missing
    firsts, exits, torch_imports = [], [], []
    for _ in range(args.runs):
        if args.cold:
            env["TORCH_EXTENSIONS_DIR"] = tempfile.mkdtemp(prefix="twostep-cold-ext-")
            env["TWOSTEP_CACHE_DIR"] = tempfile.mkdtemp(prefix="twostep-cold-cache-")
        first, done = time_to_first_byte(TWOSTEP, env)
        firsts.append(first)
        exits.append(done)
        start = time.perf_counter()
        subprocess.run([sys.executable, "-c", "import torch"], check=True)
        torch_imports.append(time.perf_counter() - start)
    print(json.dumps({"mode": "cold" if args.cold else "warm", "runs": args.runs,
                      "first_token_s": round(statistics.median(firsts), 2),
                      "exit_s": round(statistics.median(exits), 2),
                      "import_torch_s": round(statistics.median(torch_imports), 2)}))


if __name__ == "__main__":
    main()
