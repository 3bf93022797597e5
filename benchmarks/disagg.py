"""Prefill/decode disaggregation against one colocated instance with the same cores: TTFT and ITL
of a workload where long prompts (2k tokens) arrive while short chats decode.

    .venv/bin/python benchmarks/disagg.py                       # 2 reps, default model
    .venv/bin/python benchmarks/disagg.py --reps 1 --num-short 8 --long-prompts 2

Colocated: one `twostep serve --num-threads 2` on both cores. Disaggregated: a prefill instance
(kv_producer) pinned to core 0 and a decode instance (kv_consumer) pinned to core 1, one thread
each, with `twostep proxy` in front (unpinned: it only forwards bytes). The same seeded
`twostep bench serve --dataset long-short` workload goes to each, setups alternating (in turn
first); medians over reps are printed. vLLM's own docs say disaggregation does not raise
throughput; its point is that long prefills stop disturbing the decodes (ITL), which is what the
short chats' inter-token latency shows.
"""
from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

TWOSTEP = [str(Path(sys.executable).with_name("twostep")), "--log-level", "WARNING"]
KEYS = ("median_ttft_ms", "p99_ttft_ms", "median_itl_ms", "p99_itl_ms", "mean_itl_ms", "median_tpot_ms",
        "output_throughput", "duration", "failed")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Processes:
    """Servers started for one setup; all stopped on exit."""

    def __init__(self, log_dir: Path) -> None:
        self.log_dir, self.procs = log_dir, []

    def start(self, name: str, args: list[str], cpus: str | None = None) -> str:
        port = free_port()
        pin = ["taskset", "-c", cpus] if cpus else []
        log = open(self.log_dir / f"{name}-{port}.log", "wb")
        self.procs.append(subprocess.Popen([*pin, *TWOSTEP, *args, "--port", str(port)], stdout=log,
                                           stderr=subprocess.STDOUT))
        base = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.procs[-1].poll() is not None:
                raise SystemExit(f"{name} exited: see {log.name}")
            try:
                if httpx.get(base + "/health", timeout=2).status_code == 200:
                    return base
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        raise SystemExit(f"{name} did not become healthy")

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        for p in self.procs:
            p.terminate()
        for p in self.procs:
            p.wait(30)


def serve_args(args, threads: int, *extra: str) -> list[str]:
    model = ["--model", args.model] if args.model else []
    return ["serve", *model, "--num-threads", str(threads), "--max-model-len", str(args.max_model_len), *extra]


def kv_config(role: str) -> str:
    return json.dumps({"kv_connector": "ZmqConnector", "kv_role": role, "kv_port": free_port() if role == "kv_producer" else 0})


def bench(base: str, args, out: Path) -> dict:
    cmd = [*TWOSTEP, "bench", "serve", "--base-url", base, "--dataset", "long-short",
           "--num-prompts", str(args.num_short), "--input-len", str(args.short_input_len),
           "--output-len", str(args.short_output_len), "--long-prompts", str(args.long_prompts),
           "--long-input-len", str(args.long_input_len), "--long-output-len", str(args.long_output_len),
           "--request-rate", str(args.request_rate), "--save-json", str(out)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(out.read_text())


def run_setup(name: str, args, work: Path) -> dict:
    with Processes(work) as procs:
        if name == "colocated":
            base = procs.start("colocated", serve_args(args, 2))
        else:
            prefill = procs.start("prefill", serve_args(args, 1, "--kv-transfer-config", kv_config("kv_producer")), "0")
            decode = procs.start("decode", serve_args(args, 1, "--kv-transfer-config", kv_config("kv_consumer")), "1")
            base = procs.start("proxy", ["proxy", "--prefill", prefill, "--decode", decode])
        return bench(base, args, work / f"{name}-{time.monotonic_ns()}.json")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default=None, help="default: the packaged SmolLM2-135M-Instruct GGUF")
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--short-input-len", type=int, default=64)
    ap.add_argument("--short-output-len", type=int, default=128)
    ap.add_argument("--long-prompts", type=int, default=4)
    ap.add_argument("--long-input-len", type=int, default=2048)
    ap.add_argument("--long-output-len", type=int, default=16)
    ap.add_argument("--request-rate", type=float, default=1.0, help="requests per second (Poisson)")
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if os.cpu_count() < 2:
        raise SystemExit("needs two cores (one per disaggregated instance)")
    results: dict[str, list[dict]] = {"colocated": [], "disaggregated": []}
    with tempfile.TemporaryDirectory(prefix="twostep-disagg-") as tmp:
        for rep in range(args.reps):
            order = ["colocated", "disaggregated"] if rep % 2 == 0 else ["disaggregated", "colocated"]
            for name in order:
                r = run_setup(name, args, Path(tmp))
                results[name].append(r)
                print(f"rep {rep + 1}/{args.reps} {name}: " + ", ".join(f"{k} {r[k]:.1f}" for k in KEYS), file=sys.stderr)
    medians = {name: {k: statistics.median(r[k] for r in runs) for k in KEYS} for name, runs in results.items()}
    if args.json:
        print(json.dumps({"args": vars(args), "medians": medians, "runs": results}, indent=2))
        return
    print(f"{'metric':<20} {'colocated':>12} {'disaggregated':>14} {'disagg/coloc':>13}")
    for k in KEYS:
        a, b = medians["colocated"][k], medians["disaggregated"][k]
        print(f"{k:<20} {a:>12.1f} {b:>14.1f} {b / a if a else float('nan'):>13.2f}")


if __name__ == "__main__":
    main()
