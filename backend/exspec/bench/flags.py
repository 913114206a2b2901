"""The bench commands' checks of their flags (exspec-bench, python -m exspec.bench.replay): a bad
value is answered with one line naming its flag, argparse's `parser.error` (exit code 2), before
any model loads or any work starts; not with a traceback minutes in."""
from __future__ import annotations

import argparse
import json
from pathlib import Path

from ..errors import ModelLoadError
from ..models.loading import check_source


def int_list(ap: argparse.ArgumentParser, flag: str, text: str, noun: str, low: int,
             high: int | None = None) -> list[int]:
    """A comma list of integers in low..high (no top: None), sorted, without repeats."""
    try:
        values = sorted({int(v) for v in text.split(",") if v.strip()})
    except ValueError:
        values = []
    if not values or values[0] < low or (high is not None and values[-1] > high):
        bounds = f">= {low}" if high is None else f"in {low}..{high}"
        ap.error(f"{flag}: a comma list of {noun} {bounds}, got {text!r}")
    return values


def at_least(ap: argparse.ArgumentParser, flags: dict[str, int | None], low: int) -> None:
    """Each flag's number (None: not given) is at least `low`."""
    for flag, value in flags.items():
        if value is not None and value < low:
            ap.error(f"{flag} must be >= {low}, got {value}")


def model_source(ap: argparse.ArgumentParser, flag: str, name: str | None) -> None:
    """A local path that is not there (a name may also be a Hub id: the loader's rule)."""
    if name is not None:
        try:
            check_source(name, flag)
        except ModelLoadError as exc:
            ap.error(str(exc))


def writable(ap: argparse.ArgumentParser, flag: str, path: Path | None, folder: bool = False) -> None:
    """Where an output file (or folder) goes: its parent folder is there, and it is not the
    other kind of thing already."""
    if path is None:
        return
    if path.exists() and path.is_dir() != folder:
        ap.error(f"{flag} {path} is a {'file' if folder else 'folder'}; give a "
                 f"{'folder' if folder else 'file'} path")
    if not folder and not path.parent.is_dir():
        ap.error(f"{flag} {path}: its folder {path.parent} does not exist")


def read_jsonl(path: Path) -> list[tuple[int, dict]]:
    """A JSONL file's objects with their line numbers (blank lines skipped); a line that is not
    a JSON object is a ValueError naming the file and line."""
    rows = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise ValueError(f"{path}:{n} is not JSON ({exc.msg})") from None
        if not isinstance(row, dict):
            raise ValueError(f"{path}:{n} holds a {type(row).__name__}, not a JSON object")
        rows.append((n, row))
    return rows


def input_file(ap: argparse.ArgumentParser, flag: str, read, path: Path, *rest):
    """read(path, *rest), or one line naming the flag where the file is missing, unreadable or
    wrong (`read` raises OSError or ValueError)."""
    try:
        return read(path, *rest)
    except OSError as exc:
        ap.error(f"{flag} {path}: {exc.strerror or exc}")
    except ValueError as exc:
        ap.error(f"{flag}: {exc}")
