"""Prompts from a file: SpecBench question.jsonl ({"turns": [...]}, the first turn is the
prompt), other JSON lines with "prompt" or "text", or plain text, one prompt a line."""
from __future__ import annotations

import json
from pathlib import Path


def load_prompts(path: str | Path, limit: int | None = None) -> list[str]:
    prompts = []
    for number, line in enumerate(Path(path).read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        prompts.append(_prompt(line, path, number))
        if limit and len(prompts) >= limit:
            break
    if not prompts:
        raise ValueError(f"{path}: no prompts in it")
    return prompts


def _prompt(line: str, path, number: int) -> str:
    if not line.lstrip().startswith("{"):
        return line
    try:
        record = json.loads(line)
    except json.JSONDecodeError:
        return line      # a plain-text prompt that happens to start with "{"
    if isinstance(record.get("turns"), list) and record["turns"]:
        return str(record["turns"][0])
    for key in ("prompt", "text", "text_input"):
        if isinstance(record.get(key), str):
            return record[key]
    raise ValueError(f"{path}:{number}: a JSON line needs \"turns\" (SpecBench), \"prompt\" or "
                     "\"text\"")
