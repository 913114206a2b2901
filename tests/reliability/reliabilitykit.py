"""One real tritonserver for the reliability suite, started through the launcher on free ports.

Its repository serves one tiny seeded Llama pair (exspec.demo.tiny) under six model.json settings,
each its own stub process, so a fault in one model leaves the others alone:

- limits     small, explicit limits (prompt tokens, max_tokens, pool, queue): the limit tests,
             the fuzz test, and the fault-free reference for the fault tests;
- busy       the same limits with slowed ticks (fault_injection.tick_delay_s): the busy test;
- faulty     fault_injection.forward_error_every and forward_oom_every: every N-th model forward
             raises RuntimeError, every M-th torch.OutOfMemoryError;
- culprit    fault_injection.row_error_token: a step holding a request whose prompt has "~" raises
             (ticks slowed, so a request can be seen running before the culprit joins it);
- crash      fault_injection.crash_after_ticks: the engine thread dies on its N-th tick;
- slow       fault_injection.tick_delay_s above tick_timeout_s: the adapter's watchdog fires;
- admission  fault_injection.admission_delay_s: add_request takes ADMISSION_DELAY_S for a
             request whose prompt has "~" (a stand-in for a heavy grammar compile).

The SIGTERM test starts its own server (it kills it); see test_shutdown.py.
"""
from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO / "backend"))
sys.path.insert(0, str(REPO / "tests"))

pytest.importorskip("tritonclient.grpc", reason="needs the serve extra: pip install -e '.[serve]'")

from exspec.serving.launcher import TritonServer, stub_pids  # noqa: E402,F401  (stub_pids: for the tests)
from exspec.demo.tiny import build_tokenizer, llama, noisy_copy, save_pair  # noqa: E402
from modelrepo import copy_unary, write_model  # noqa: E402,F401  (tests/modelrepo.py)


def _load(name: str, path: Path):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module   # dataclasses look their module up here
    spec.loader.exec_module(module)
    return module


# The integration suite's helpers (real tritonclient calls, metric scraping), loaded by path:
# tests/integration is not on this suite's import path.
_it = _load("exspec_integration_helpers", REPO / "tests" / "integration" / "serverkit.py")
clients = _load("exspec_integration_clients", REPO / "tests" / "integration" / "clients.py")
scrape, wait_for, fill_pool_and_queue = _it.scrape, _it.wait_for, _it.fill_pool_and_queue

LIMITS = {"max_prompt_tokens": 48, "max_output_tokens": 64, "default_max_tokens": 8,
          "max_batch_size": 2, "max_num_seqs": 2, "max_queue_len": 2, "max_request_bytes": 65536}
_SPEC = {"method": "exspec", "num_speculative_tokens": 4, "max_batch_size": 2, "max_num_seqs": 8,
         "default_max_tokens": 8, "max_output_tokens": 256}
CULPRIT_TOKEN = 94   # "~" in the toy tokenizer: a request holding it raises in every step
MODELS = {
    "limits": {"method": "exspec", "num_speculative_tokens": 4, **LIMITS},
    # the same limits with slowed ticks: requests hold the pool long enough to be seen full
    "busy": {"method": "exspec", "num_speculative_tokens": 4, **LIMITS,
             "fault_injection": {"tick_delay_s": 0.05}},
    "faulty": {**_SPEC, "fault_injection": {"forward_error_every": 150, "forward_oom_every": 230}},
    "culprit": {**_SPEC, "fault_injection": {"row_error_token": CULPRIT_TOKEN, "tick_delay_s": 0.05}},
    "crash": {**_SPEC, "fault_injection": {"crash_after_ticks": 6}},
    "slow": {**_SPEC, "tick_timeout_s": 0.5, "fault_injection": {"tick_delay_s": 2.5}},
    "admission": {**_SPEC, "fault_injection": {"admission_delay_token": CULPRIT_TOKEN,
                                               "admission_delay_s": 4.0}},
}


def build_pair(root: Path) -> Path:
    tokenizer = build_tokenizer()
    target = llama(len(tokenizer), 31, layers=2, hidden=64, max_positions=1024,
                   eos_token_id=tokenizer.eos_token_id)
    return save_pair(root / "pair", tokenizer, target, noisy_copy(target, 32, scale=0.05))


@pytest.fixture(scope="session")
def pair(tmp_path_factory) -> Path:
    return build_pair(tmp_path_factory.mktemp("exspec-rel-pair"))


@pytest.fixture(scope="session")
def rel_server(pair, tmp_path_factory):
    root = tmp_path_factory.mktemp("exspec-rel")
    repo = root / "models"
    for name, engine in MODELS.items():
        write_model(repo, name, pair, engine)
    log = root / "tritonserver.log"
    with TritonServer(repo, free_ports=True, startup_timeout_s=300, log_path=log,
                      extra_args=["--exit-timeout-secs=10"]) as server:
        yield server
        if os.environ.get("EXSPEC_KEEP_LOG"):
            shutil.copy(log, os.environ["EXSPEC_KEEP_LOG"])


def server_log(server) -> str:
    return Path(server.log_path).read_text(errors="replace")


def ready(server, model: str | None = None) -> bool:
    import urllib.error
    import urllib.request
    path = f"/v2/models/{model}/ready" if model else "/v2/health/ready"
    try:
        with urllib.request.urlopen(server.urls["http"] + path, timeout=5) as r:
            return r.status == 200
    except (urllib.error.URLError, OSError):
        return False


def wait_gone(pids_fn, timeout_s: float) -> list[int]:
    deadline = time.monotonic() + timeout_s
    left = pids_fn()
    while left and time.monotonic() < deadline:
        time.sleep(0.2)
        left = pids_fn()
    return left
