"""Resident memory of twostep and llama.cpp holding the same GGUF file, each in its own process.

    .venv/bin/python benchmarks/resident_memory.py FILE.gguf [FILE.gguf ...]

twostep: a process that loads the file (16 MiB of KV cache), generates one token and reports its
resident set (VmRSS) then, and its peak (ru_maxrss, which includes the load's temporaries).
llama.cpp: `llama-bench -p 16 -n 16 -r 1` on the same file (its default mmap; found as compare.py
finds it), peak resident set from the kernel's accounting of the child (ru_maxrss). Both counts
include the file pages a memory-mapped load touches.
"""
from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
from pathlib import Path

TWOSTEP = """
import resource, sys
from twostep import LLM, SamplingParams
llm = LLM(sys.argv[1], dtype="float32", kv_cache_memory="16MiB", max_model_len=256)
llm.generate([{"prompt_token_ids": [1, 2, 3]}], SamplingParams(max_tokens=1), use_tqdm=False)
rss = next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("VmRSS"))
print(rss, resource.getrusage(resource.RUSAGE_SELF).ru_maxrss)
"""


def llama_bench() -> str | None:
    folder = os.environ.get("LLAMA_CPP_BIN_DIR")
    if folder and (Path(folder) / "llama-bench").is_file():
        return str(Path(folder) / "llama-bench")
    return shutil.which("llama-bench")


def child_peak_kib(cmd: list[str]) -> int:
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _, status, usage = os.wait4(proc.pid, 0)
    if status != 0:
        raise SystemExit(f"{cmd[0]} failed (status {status})")
    return usage.ru_maxrss


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    args = ap.parse_args()
    bench = llama_bench()
    print("| file | size | twostep after load | twostep peak | llama.cpp peak | twostep / llama.cpp |")
    print("|---|---|---|---|---|---|")
    for path in args.files:
        out = subprocess.run([sys.executable, "-c", TWOSTEP, path], capture_output=True, text=True, check=True)
        rss, peak = (int(v) for v in out.stdout.split()[-2:])
        theirs = child_peak_kib([bench, "-m", path, "-p", "16", "-n", "16", "-r", "1", "-t", "2"]) if bench else None
        ratio = f"{rss / theirs:.2f}" if theirs else "-"
        print(f"| {Path(path).name} | {os.path.getsize(path) / 2**20:,.0f} MiB | {rss / 1024:,.0f} MiB | "
              f"{peak / 1024:,.0f} MiB | {theirs / 1024 if theirs else float('nan'):,.0f} MiB | {ratio} |")


if __name__ == "__main__":
    main()
