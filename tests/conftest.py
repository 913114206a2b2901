"""Shared test settings: one torch thread (tiny models gain nothing from more, and a second
thread on a busy 2-core machine costs 100x per forward), quiet progress bars."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


# `make test` runs on two pytest-xdist workers (--dist loadgroup). Each group runs whole on one
# worker: a suite folder whose session fixtures start a tritonserver (started once per worker
# that runs the group, so the folder stays together), and otherwise one test file (its module
# fixtures, such as the loaded real pair, are built once).
SERVER_SUITES = ("integration", "reliability", "load", "deploy")


def pytest_collection_modifyitems(items):
    for item in items:
        path = item.path.relative_to(item.config.rootpath)
        suite = path.parts[1] if len(path.parts) > 2 else None
        group = f"tests/{suite}" if suite in SERVER_SUITES else str(path)
        item.add_marker(pytest.mark.xdist_group(group))
