"""The chart's PrometheusRule through Prometheus' own tool: `promtool check rules` on every
values file's rules, `promtool test rules` with synthetic exspec series (promtool/rules_test.yaml)."""
from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from deploykit import VALUES_FILES, load_values, need_binary, one, render

HERE = Path(__file__).resolve().parent


def write_rules(values_name: str, folder: Path) -> Path:
    rule = one(render(load_values(values_name)), "PrometheusRule")
    path = folder / "rules.yaml"
    path.write_text(yaml.safe_dump({"groups": rule["spec"]["groups"]}, sort_keys=False))
    return path


@pytest.mark.parametrize("name", [n for n in VALUES_FILES if load_values(n)["metrics"]["rules"]["enabled"]])
def test_promtool_accepts_the_rules(name, tmp_path):
    promtool = need_binary("promtool")
    rules = write_rules(name, tmp_path)
    run = subprocess.run([promtool, "check", "rules", str(rules)], capture_output=True, text=True,
                         timeout=60)
    assert run.returncode == 0, f"promtool check rules ({name}.yaml):\n{run.stdout}{run.stderr}"
    count = sum(len(g["rules"]) for g in yaml.safe_load(rules.read_text())["groups"])
    assert count >= 10 and f"SUCCESS: {count} rules found" in run.stdout, run.stdout


def test_rules_record_and_alert_as_intended_on_synthetic_series(tmp_path):
    promtool = need_binary("promtool")
    write_rules("gpu", tmp_path)
    shutil.copy(HERE / "promtool" / "rules_test.yaml", tmp_path / "rules_test.yaml")
    run = subprocess.run([promtool, "test", "rules", "rules_test.yaml"], cwd=tmp_path,
                         capture_output=True, text=True, timeout=60)
    assert run.returncode == 0, f"promtool test rules:\n{run.stdout}{run.stderr}"
