"""Writing test model repositories: one place for the layout every served test uses (the
shipped config.pbtxt, a model.json pointing at a saved pair, the unary front model)."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def write_model(repo: Path, name: str, pair: Path, engine: dict, config_extra: str = "") -> None:
    """repo/name: the shipped exspec config.pbtxt and a model.json for the pair in `pair`."""
    write_model_json(repo, name, {
        "target_model": str(pair / "target"), "draft_model": str(pair / "draft"),
        "tokenizer": str(pair / "tokenizer"), **engine}, config_extra)


def write_model_json(repo: Path, name: str, model_json: dict, config_extra: str = "") -> None:
    """repo/name: the shipped exspec config.pbtxt and this model.json, as it is."""
    (repo / name / "1").mkdir(parents=True)
    config = (REPO / "model_repository" / "exspec" / "config.pbtxt").read_text()
    (repo / name / "config.pbtxt").write_text(config + config_extra)
    (repo / name / "1" / "model.json").write_text(json.dumps(model_json, indent=1))


def copy_unary(repo: Path) -> None:
    """The repository's unary (BLS) front model, which serves /infer for model `exspec`."""
    shutil.copytree(REPO / "model_repository" / "exspec_unary", repo / "exspec_unary",
                    ignore=shutil.ignore_patterns("__pycache__"))
