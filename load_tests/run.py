"""Run locust headless against a running exspec server, keep its CSVs, print a summary table.

    python load_tests/run.py --url http://127.0.0.1:8000 --users 4 --run-time 60 \
        --out runs/load/c4 [--grpc-url 127.0.0.1:8001] [--protocols grpc,http] \
        [--max-tokens 64] [--num-speculative-tokens 5] [--requests-per-user N] [-- locust args]

--users is per protocol. Writes <out>_stats.csv, <out>_stats_history.csv, <out>_failures.csv,
<out>_exceptions.csv (locust's), <out>_exspec.json (most requests in flight per protocol) and
<out>_summary.json (the table below). Exits non-zero when locust does (any failure).
"""
from __future__ import annotations

import argparse
import csv
import json
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
USERS = {"grpc": "GrpcStreamUser", "http": "HttpSseUser"}
PASS_THROUGH = ("model", "grpc_url", "prompts_file", "max_tokens", "temperature", "top_p",
                "top_k", "seed", "num_speculative_tokens", "requests_per_user",
                "request_timeout")


def parse_args(argv):
    argv = list(sys.argv[1:] if argv is None else argv)
    extra = []
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1:]
    p = argparse.ArgumentParser(prog="load_tests/run.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--url", required=True, help="the server's HTTP URL, http://host:port")
    p.add_argument("--grpc-url", default=None, help="gRPC host:port (default: HTTP port + 1)")
    p.add_argument("--protocols", default="grpc,http")
    p.add_argument("--users", type=int, default=4, help="concurrent users per protocol")
    p.add_argument("--run-time", type=int, default=60, help="seconds")
    p.add_argument("--stop-timeout", type=int, default=60,
                   help="seconds users get to finish their request once the time is up")
    p.add_argument("--out", default="runs/load/run", help="CSV prefix")
    p.add_argument("--model", default=None)
    p.add_argument("--prompts-file", default=None)
    p.add_argument("--max-tokens", type=int, default=None)
    p.add_argument("--temperature", type=float, default=None)
    p.add_argument("--top-p", type=float, default=None)
    p.add_argument("--top-k", type=int, default=None)
    p.add_argument("--seed", type=int, default=None)
    p.add_argument("--ignore-eos", action="store_true")
    p.add_argument("--num-speculative-tokens", type=int, default=None)
    p.add_argument("--requests-per-user", type=int, default=None)
    p.add_argument("--request-timeout", type=float, default=None)
    args = p.parse_args(argv)
    args.protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    unknown = set(args.protocols) - set(USERS)
    if unknown:
        p.error(f"unknown protocol(s) {sorted(unknown)}; choose from {sorted(USERS)}")
    return args, extra


def locust_command(args, extra) -> list[str]:
    users = args.users * len(args.protocols)
    cmd = [sys.executable, "-m", "locust", "-f", str(HERE / "locustfile.py"), "--headless",
           "-u", str(users), "-r", str(users), "-t", f"{args.run_time}s",
           "-s", str(args.stop_timeout), "--host", args.url, "--csv", args.out,
           "--only-summary", "--loglevel", "WARNING"]
    for name in PASS_THROUGH:
        value = getattr(args, name)
        if value is not None:
            cmd += [f"--{name.replace('_', '-')}", str(value)]
    if args.ignore_eos:
        cmd.append("--ignore-eos")
    return cmd + extra + [USERS[p] for p in args.protocols]


def read_stats(prefix: str) -> dict:
    """{(type, name): row} from locust's <prefix>_stats.csv."""
    with open(f"{prefix}_stats.csv", newline="") as f:
        return {(row["Type"], row["Name"]): row for row in csv.DictReader(f)}


def summarize(prefix: str, protocols) -> list[dict]:
    stats = read_stats(prefix)
    extra_path = Path(f"{prefix}_exspec.json")
    in_flight = json.loads(extra_path.read_text())["max_in_flight"] if extra_path.exists() else {}
    rows = []
    for protocol in protocols:
        main = stats.get((protocol, "generate_stream"))
        if main is None:
            rows.append({"protocol": protocol, "requests": 0, "failures": 0})
            continue
        ttft = stats.get((protocol, "ttft"), {})
        itl = stats.get((protocol, "itl"), {})
        num = lambda row, key: float(row[key]) if row.get(key) not in (None, "", "N/A") else None  # noqa: E731
        requests, failures = int(main["Request Count"]), int(main["Failure Count"])
        ok = requests - failures
        # Average Content Size = output tokens per request (failures count 0 tokens).
        tokens = num(main, "Average Content Size") * requests if requests else 0.0
        rows.append({
            "protocol": protocol, "requests": requests, "failures": failures,
            "requests_per_s": num(main, "Requests/s"),
            "output_tokens": round(tokens),
            "output_tokens_per_s": (num(main, "Requests/s") or 0.0) * (tokens / requests if requests else 0.0),
            "latency_p50_ms": num(main, "50%"), "latency_p95_ms": num(main, "95%"),
            "ttft_p50_ms": num(ttft, "50%"), "ttft_p95_ms": num(ttft, "95%"),
            "itl_p50_ms": num(itl, "50%"), "itl_p95_ms": num(itl, "95%"),
            "max_in_flight": in_flight.get(protocol), "ok": ok})
    return rows


def table(rows: list[dict]) -> str:
    head = ["protocol", "requests", "failures", "req/s", "out tok/s", "latency p50/p95 ms",
            "TTFT p50/p95 ms", "ITL p50/p95 ms", "max in flight"]
    fmt = lambda v, d=1: "-" if v is None else f"{v:.{d}f}"   # noqa: E731
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        if not r["requests"]:
            lines.append(f"| {r['protocol']} | 0 | 0 |" + " - |" * (len(head) - 3))
            continue
        lines.append("| " + " | ".join([
            r["protocol"], str(r["requests"]), str(r["failures"]), fmt(r["requests_per_s"], 2),
            fmt(r["output_tokens_per_s"]),
            f"{fmt(r['latency_p50_ms'], 0)} / {fmt(r['latency_p95_ms'], 0)}",
            f"{fmt(r['ttft_p50_ms'], 0)} / {fmt(r['ttft_p95_ms'], 0)}",
            f"{fmt(r['itl_p50_ms'], 0)} / {fmt(r['itl_p95_ms'], 0)}",
            str(r["max_in_flight"] if r["max_in_flight"] is not None else "-")]) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    cmd = locust_command(args, extra)
    print("$ " + " ".join(cmd), flush=True)
    code = subprocess.call(cmd)
    if not Path(f"{args.out}_stats.csv").exists():
        print(f"run.py: locust wrote no {args.out}_stats.csv (exit code {code})", file=sys.stderr)
        return code or 1
    rows = summarize(args.out, args.protocols)
    Path(f"{args.out}_summary.json").write_text(json.dumps(rows, indent=1))
    print(table(rows))
    print(f"CSVs: {args.out}_stats.csv, {args.out}_stats_history.csv, {args.out}_failures.csv")
    return code


if __name__ == "__main__":
    sys.exit(main())
