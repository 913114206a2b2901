"""Shared test settings: one torch thread (tiny models gain nothing from more, and a second
thread on a busy 2-core machine costs 100x per forward), quiet progress bars."""
import os

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")

import torch  # noqa: E402

torch.set_num_threads(1)
