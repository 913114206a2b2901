"""Shared pieces of the deploy suite (a plain module, as each suite's kit is: a conftest is not
importable by a name of its own): rendering the Helm chart offline (helm-python-sdk), the
exspec metric registry read from the code, and the rule that a missing tool fails in CI
(CI=true) and is skipped, with the reason, on a developer's machine."""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "deploy" / "helm" / "exspec"
VALUES_DIR = REPO / "deploy" / "helm" / "values"
VALUES_FILES = ("cpu", "gpu", "multi-gpu", "big-target")
KSERVE = REPO / "deploy" / "kserve"
RELEASE, NAMESPACE = "exspec", "llm"
sys.path.insert(0, str(REPO / "backend"))
sys.path.insert(0, str(REPO / "client"))   # the shipped client (exspec_client), as users run it


def missing(what: str, how: str):
    """A tool the deploy tests need is absent: fail in CI, skip with the reason elsewhere."""
    message = f"{what} is missing; {how}"
    if os.environ.get("CI", "").lower() == "true":
        pytest.fail(message, pytrace=False)
    pytest.skip(message)


def need_binary(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        missing(f"the {name} binary", "run deploy/ci-deps.sh (Debian packages prometheus, haproxy)")
    return path


def need_module(name: str):
    try:
        return importlib.import_module(name)
    except ImportError:
        missing(f"the Python module {name}", "pip install -e '.[test]' (helm-python-sdk, "
                "kubernetes-validate)")


def load_values(name: str) -> dict:
    return yaml.safe_load((VALUES_DIR / f"{name}.yaml").read_text())


def deep_merge(base: dict, override: dict) -> dict:
    out = dict(base)
    for key, value in override.items():
        out[key] = (deep_merge(out[key], value) if isinstance(value, dict)
                    and isinstance(out.get(key), dict) else value)
    return out


def render(values: dict | None = None) -> list[dict]:
    """The chart's objects for these values (schema-checked by Helm as an install would)."""
    helm = need_module("helm_python")
    with helm.Chart.load(str(CHART)) as chart:
        manifests = chart.render(values=values or {}, name=RELEASE, namespace=NAMESPACE,
                                 is_install=True)
    docs = []
    for path, text in sorted(manifests.items()):
        if path.endswith("NOTES.txt"):
            continue
        docs += [doc for doc in yaml.safe_load_all(text) if doc]
    return docs


def one(docs: list[dict], kind: str, suffix: str = "") -> dict:
    found = [d for d in docs if d["kind"] == kind and d["metadata"]["name"].endswith(suffix)]
    assert len(found) == 1, f"expected one {kind}*{suffix}, got {[d['metadata']['name'] for d in found]}"
    return found[0]


def registry_families() -> dict[str, str]:
    """Every metric family backend/exspec_metrics.py registers, read by running its Metrics
    class against a recording stand-in for Triton's pb_utils (the real one exists only inside
    the Python backend stub)."""
    families: dict[str, str] = {}

    class MetricFamily:
        COUNTER, GAUGE, HISTOGRAM = "counter", "gauge", "histogram"

        def __init__(self, name, description, kind):
            families[name] = kind

        def Metric(self, labels=None, buckets=None):   # noqa: N802 (Triton's name)
            return types.SimpleNamespace(increment=lambda *_: None, set=lambda *_: None,
                                         observe=lambda *_: None)

    fake = types.ModuleType("triton_python_backend_utils")
    fake.MetricFamily = MetricFamily
    saved = sys.modules.get("triton_python_backend_utils")
    sys.modules["triton_python_backend_utils"] = fake
    try:
        spec = importlib.util.spec_from_file_location("_exspec_metrics_for_deploy",
                                                      REPO / "backend" / "exspec_metrics.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        module.Metrics("exspec", "1")
    finally:
        if saved is None:
            sys.modules.pop("triton_python_backend_utils", None)
        else:
            sys.modules["triton_python_backend_utils"] = saved
    return families


def registry_series() -> set[str]:
    """Series names Prometheus sees from exspec: histograms add _bucket, _sum and _count."""
    out = set()
    for name, kind in registry_families().items():
        out.add(name)
        if kind == "histogram":
            out |= {f"{name}_bucket", f"{name}_sum", f"{name}_count"}
    return out
