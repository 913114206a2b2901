"""utils/text_locale.py: a process left in the C locale (as Triton's stub leaves its embedded
Python) reads text as ASCII, and inductor's UTF-8 templates then fail to load; utf8_text sets
LC_CTYPE so they load. Run in a child Python with the C locale and neither of the `python`
program's own UTF-8 rescues (PEP 538's coercion, PEP 540's mode), as an embedded one has."""
import os
import subprocess
import sys

import pytest

LOAD = "import torch._inductor.kernel.mm_grouped"   # reads a template holding UTF-8


@pytest.mark.parametrize("fixed", [False, True])
def test_inductor_templates_load_in_the_c_locale_once_utf8_text_ran(fixed):
    env = dict(os.environ, LC_ALL="C", LANG="C", PYTHONCOERCECLOCALE="0", PYTHONUTF8="0")
    code = ("import locale; assert locale.getpreferredencoding(False) == 'ANSI_X3.4-1968'\n"
            + ("from exspec.utils.text_locale import utf8_text; utf8_text()\n" if fixed else "")
            + LOAD)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    if fixed:
        assert run.returncode == 0, run.stderr[-2000:]
    else:   # the negative control: the failure the stub met
        assert "UnicodeDecodeError: 'ascii' codec" in run.stderr, run.stderr[-2000:]
