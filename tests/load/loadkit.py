"""One real tritonserver for the client and load tests: the tiny seeded Llama pair (exspec.demo.tiny)
as model `exspec` (and as `exspec_slow`, its ticks slowed, for the timeout tests), plus the repository's BLS front model `exspec_unary`, started through the
launcher on free loopback ports. Metric helpers come from the integration suite's serverkit."""
from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend"))
sys.path.insert(0, str(REPO / "tests"))
sys.path.insert(0, str(REPO / "client"))

pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install -e '.[serve]'")

from exspec.serving.launcher import TritonServer  # noqa: E402
from exspec.demo.tiny import build_tokenizer, llama, noisy_copy, save_pair  # noqa: E402
from modelrepo import copy_unary, write_model  # noqa: E402,F401  (tests/modelrepo.py)


def _integration_helpers():
    path = REPO / "tests" / "integration" / "serverkit.py"
    spec = importlib.util.spec_from_file_location("exspec_integration_helpers", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


_helpers = _integration_helpers()
scrape, wait_for = _helpers.scrape, _helpers.wait_for
ENGINE = {**_helpers.MODELS["exspec"], "max_num_seqs": 32}
# The same engine with every tick 50 ms or longer: a request of 400 tokens takes seconds on any
# machine, so the timeout and cancellation tests do not race the tiny model's speed (at
# ~1 ms a tick a 400-token request could finish inside a 0.5 s timeout).
SLOW_MODEL = "exspec_slow"
SLOW_ENGINE = {**ENGINE, "fault_injection": {"tick_delay_s": 0.05}}
PROMPTS = ["def add(a, b):\n", "for i in range(10):\n", "The quick brown fox",
           "import os\nimport sys\n", "hello world, hello", "class Engine:\n"]


def build_repository(root: Path) -> Path:
    tokenizer = build_tokenizer()
    target = llama(len(tokenizer), 11, layers=2, hidden=64, max_positions=512,
                   eos_token_id=tokenizer.eos_token_id)
    pair = save_pair(root / "pair", tokenizer, target, noisy_copy(target, 12, scale=0.05))
    repo = root / "models"
    write_model(repo, "exspec", pair, ENGINE)
    write_model(repo, SLOW_MODEL, pair, SLOW_ENGINE)
    copy_unary(repo)
    return repo


@pytest.fixture(scope="session")
def load_server(tmp_path_factory):
    root = tmp_path_factory.mktemp("exspec-load")
    with TritonServer(build_repository(root), free_ports=True, startup_timeout_s=300,
                      log_path=root / "tritonserver.log",
                      extra_args=["--exit-timeout-secs=20"]) as server:
        yield server


@pytest.fixture(scope="session")
def prompts_file(tmp_path_factory) -> Path:
    """The prompts in SpecBench's question.jsonl format."""
    path = tmp_path_factory.mktemp("prompts") / "question.jsonl"
    path.write_text("".join(json.dumps({"question_id": i, "category": "code", "turns": [p]}) + "\n"
                            for i, p in enumerate(PROMPTS)))
    return path


class Metrics:
    """The server's exspec metrics as the tests read them (test modules take this fixture
    rather than importing from a conftest)."""

    def __init__(self, server):
        self.server = server

    def outcomes(self) -> dict:
        """exspec:requests_total by outcome."""
        return {o: scrape(self.server, "exspec:requests_total", outcome=o)
                for o in ("stop", "length", "abort", "cancelled", "error", "rejected")}

    def wait_pool_empty(self, timeout_s: float = 20.0) -> None:
        wait_for(lambda: scrape(self.server, "exspec:num_requests_running") == 0, timeout_s,
                 "exspec:num_requests_running to return to 0")

    def wait_outcome(self, outcome: str, at_least: float, timeout_s: float = 20.0) -> None:
        wait_for(lambda: self.outcomes()[outcome] >= at_least, timeout_s,
                 f"exspec:requests_total{{outcome={outcome}}} to reach {at_least}")


@pytest.fixture(scope="session")
def metrics(load_server) -> Metrics:
    return Metrics(load_server)
