"""A/B of EXSPEC's KV storage between two checkouts (e.g. an older checkout with the SlotKV layout, and
this tree's block store with its per-forward gather): the same greedy workload through
LLMEngine.generate (exspec, eager path, demo pair), each checkout in its own process,
interleaved A B A B, median tokens/s per batch size.

    python scripts/kv_layout_ab.py --a /path/to/old/backend --b backend --repeats 5
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEMO = ROOT / "model_repository" / "exspec" / "1" / "demo"

RUN = r"""
import json, sys, time, torch
torch.set_num_threads(int(sys.argv[3]))
from exspec import EngineConfig, LLMEngine, SamplingParams
demo, batch = sys.argv[1], int(sys.argv[2])
engine = LLMEngine(EngineConfig(target_model=f"{demo}/target", draft_model=f"{demo}/draft",
                                tokenizer=f"{demo}/tokenizer", method="exspec", max_batch_size=batch,
                                adaptive_k=False, num_speculative_tokens=5, torch_threads=int(sys.argv[3])))
prompts = [json.loads(l)["turns"][0] for l in open(f"{demo}/prompts.jsonl") if l.strip()][:16]
params = SamplingParams(max_tokens=64, ignore_eos=True)
engine.generate(prompts[:2], SamplingParams(max_tokens=8))
start = time.perf_counter()
outs = engine.generate(prompts, params)
print(json.dumps({"tokens_per_s": sum(len(o.token_ids) for o in outs) / (time.perf_counter() - start),
                  "threads": torch.get_num_threads()}))
"""


def one(backend: str, batch: int, threads: int) -> float:
    out = subprocess.run([sys.executable, "-c", RUN, str(DEMO), str(batch), str(threads)],
                         env={"PYTHONPATH": str(Path(backend).resolve()), "PATH": "/usr/bin:/bin"},
                         capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])["tokens_per_s"]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="backend/ folder of checkout A")
    ap.add_argument("--b", required=True, help="backend/ folder of checkout B")
    ap.add_argument("--batch-sizes", default="1,8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    print(f"torch threads {args.threads}; A = {args.a}; B = {args.b}")
    for batch in (int(b) for b in args.batch_sizes.split(",")):
        runs = {"A": [], "B": []}
        for _ in range(args.repeats):
            for name, backend in (("A", args.a), ("B", args.b)):
                runs[name].append(one(backend, batch, args.threads))
        a, b = statistics.median(runs["A"]), statistics.median(runs["B"])
        print(f"B={batch}: A {a:.1f} tokens/s, B {b:.1f} tokens/s, B/A {b / a:.3f} "
              f"(runs A {[round(x, 1) for x in runs['A']]}, B {[round(x, 1) for x in runs['B']]})")


if __name__ == "__main__":
    main()
