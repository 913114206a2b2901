"""MkDocs hook: the site's home page is README.md itself, so the two never drift apart.

README links into docs/ (`docs/engine.md`); on the site those pages sit next to the home page,
so the `docs/` prefix is dropped.
"""
import re
from pathlib import Path

from mkdocs.structure.files import File


def on_files(files, config):
    readme = Path(config["config_file_path"]).parent / "README.md"
    text = re.sub(r"\]\(docs/", "](", readme.read_text(encoding="utf-8"))
    files.append(File.generated(config, "index.md", content=text))
    return files
