"""Which processor a figure was measured on: speed-ups on a CPU depend on it (a verification
of a few tokens costs 1.1x one token on one Xeon and 2x on one EPYC)."""
from __future__ import annotations

import platform
from pathlib import Path


def processor_name() -> str:
    """The CPU's model name (/proc/cpuinfo), else what platform knows."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()
