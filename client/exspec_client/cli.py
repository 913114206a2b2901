"""exspec-client: one prompt streamed to the terminal, or a file of prompts with a concurrency
limit. Ctrl-C cancels the request(s) on the server.

    exspec-client "What is the capital of France?" --chat --max-tokens 64
    exspec-client "def fib(n):" --model exspec --protocol http --url http://127.0.0.1:8000 --json
    exspec-client --prompts question.jsonl --concurrency 4 --max-tokens 128
"""
from __future__ import annotations

import argparse
import json
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

from tritonclient.utils import InferenceServerException

from .client import Client
from .prompts import load_prompts
from .types import DEFAULT_MODEL, ExspecError, Result


def parse_args(argv):
    p = argparse.ArgumentParser(prog="exspec-client", description=__doc__.split("\n\n")[0])
    p.add_argument("prompt", nargs="?", help="the prompt (or use --prompts FILE)")
    p.add_argument("--prompts", metavar="FILE",
                   help="SpecBench question.jsonl ({\"turns\": [...]}) or one prompt a line")
    p.add_argument("--limit", type=int, default=None, help="use the first N prompts of --prompts")
    p.add_argument("--concurrency", type=int, default=1, help="requests in flight with --prompts")
    p.add_argument("--url", default=None, help="gRPC host:port (default 127.0.0.1:8001) or "
                   "http://host:port (default http://127.0.0.1:8000)")
    p.add_argument("--protocol", choices=("grpc", "http"), default=None,
                   help="default: from the URL's scheme, else grpc")
    p.add_argument("--model", default=DEFAULT_MODEL,
                   help=f"the served model (default {DEFAULT_MODEL}, what `make serve` serves; the "
                   "toy pair of the tests is exspec)")
    p.add_argument("--chat", action="store_true",
                   help="send each prompt as a user message: the server renders it with the "
                   "model's own chat template (an instruct model's way to be asked)")
    p.add_argument("--system", default=None, help="with --chat: a system message first")
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--stop", action="append", default=None, help="a stop string (repeatable)")
    p.add_argument("--num-speculative-tokens", type=int, default=None,
                   help="per-request cap on k (0: no speculation)")
    p.add_argument("--no-stream", action="store_true",
                   help="ask for one response (stream=false) instead of a stream")
    p.add_argument("--unary", action="store_true",
                   help="unary infer() on <model>_unary instead of a streaming call")
    p.add_argument("--json", action="store_true",
                   help="print one JSON object per request (text, tokens, timings)")
    p.add_argument("--timeout", type=float, default=None, help="seconds per request")
    args = p.parse_args(argv)
    if (args.prompt is None) == (args.prompts is None):
        p.error("give a prompt or --prompts FILE (one of the two)")
    if args.concurrency < 1:
        p.error("--concurrency must be >= 1")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    return args


def as_request(prompt: str, args):
    """The prompt as sent: its text, or with --chat a chat of one user turn (and --system)."""
    if not args.chat:
        return prompt
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    return system + [{"role": "user", "content": prompt}]


def sampling(args) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": args.stop,
            "num_speculative_tokens": args.num_speculative_tokens}


class Session:
    """Runs requests and remembers those in flight, so Ctrl-C can cancel them all."""

    def __init__(self, client: Client, args):
        self.client, self.args = client, args
        self.active = set()
        self.lock = threading.Lock()

    def run(self, prompt: str, echo: bool = False) -> Result:
        prompt = as_request(prompt, self.args)
        if self.args.unary:
            result = self.client.infer(prompt, timeout_s=self.args.timeout, **sampling(self.args))
            if echo:
                print(result.text, flush=True)
            return result
        generation = self.client.stream(prompt, timeout_s=self.args.timeout,
                                        stream=not self.args.no_stream, **sampling(self.args))
        with self.lock:
            self.active.add(generation)
        try:
            with generation:
                for delta in generation:
                    if echo:
                        sys.stdout.write(delta.text)
                        sys.stdout.flush()
            if echo:
                print(flush=True)
            return generation.result
        finally:
            with self.lock:
                self.active.discard(generation)

    def cancel_all(self):
        with self.lock:
            active = list(self.active)
        for generation in active:
            generation.close()


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        client = Client(args.url, protocol=args.protocol, model=args.model)
    except ValueError as exc:
        print(f"exspec-client: {exc}", file=sys.stderr)
        return 2
    session = Session(client, args)
    try:
        if args.prompt is not None:
            return one(session, args)
        return many(session, args)
    except (InferenceServerException, OSError) as exc:   # nothing answers at the address
        print(f"exspec-client: cannot reach a server at {client.url} over {client.protocol} "
              f"({str(exc).splitlines()[0]}); is it running? `make serve` listens on "
              f"127.0.0.1:8001 (gRPC) and 127.0.0.1:8000 (HTTP)", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        session.cancel_all()
        print("\nexspec-client: interrupted; request(s) cancelled on the server", file=sys.stderr)
        return 130


def one(session: Session, args) -> int:
    try:
        result = session.run(args.prompt, echo=not args.json)
    except ExspecError as exc:
        print(f"exspec-client: server error: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result.as_dict()))
    else:
        print(f"-- {result.summary()}", file=sys.stderr)
    return 0


def many(session: Session, args) -> int:
    prompts = load_prompts(args.prompts, args.limit)
    results: list[Result | None] = [None] * len(prompts)
    errors = 0
    start = time.perf_counter()

    def work(i):
        return i, session.run(prompts[i])

    pool = ThreadPoolExecutor(args.concurrency)
    try:
        futures = [pool.submit(work, i) for i in range(len(prompts))]
        for future in futures:
            try:
                i, result = future.result()
            except ExspecError as exc:
                errors += 1
                i = futures.index(future)
                print(json.dumps({"index": i, "error": exc.message, "status": str(exc.status)})
                      if args.json else f"[{i}] error: {exc}", flush=True)
                continue
            results[i] = result
            print(json.dumps({"index": i, **result.as_dict()}) if args.json
                  else f"[{i}] {result.summary()}", flush=True)
    finally:
        for future in futures if "futures" in locals() else []:
            future.cancel()
        session.cancel_all()
        pool.shutdown(wait=True, cancel_futures=True)
    wall = time.perf_counter() - start
    done = [r for r in results if r is not None]
    tokens = sum(r.num_output_tokens for r in done)
    ttfts = sorted(r.ttft_s for r in done if r.ttft_s is not None)
    drafted = sum(r.draft_tokens for r in done)
    accepted = sum(r.accepted_draft_tokens for r in done)
    pct = lambda q: f"{ttfts[min(len(ttfts) - 1, int(q * len(ttfts)))] * 1000:.0f} ms" if ttfts else "-"  # noqa: E731
    print(f"-- {len(done)} ok, {errors} failed, {tokens} tokens in {wall:.1f} s = "
          f"{tokens / wall:.1f} tokens/s at concurrency {args.concurrency}; TTFT p50 {pct(0.5)} "
          f"p95 {pct(0.95)}; acceptance "
          f"{accepted / drafted if drafted else float('nan'):.2f} ({accepted}/{drafted})",
          file=sys.stderr)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
