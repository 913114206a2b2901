"""Text files read as UTF-8 in a process whose locale was never set.

Triton's Python backend stub embeds Python without setting the process locale from the
environment, so its LC_CTYPE is "C" and `open()` reads text as ASCII whatever LANG says
(PEP 538's coercion and PEP 540's UTF-8 mode apply only to the `python` program). Inductor
reads its kernel templates with `open()` and they hold UTF-8, so the compiled decode path failed
to load in tritonserver with "UnicodeDecodeError: 'ascii' codec can't decode byte 0xe2".
"""
from __future__ import annotations

import codecs
import locale


def _utf8() -> bool:
    return codecs.lookup(locale.getpreferredencoding(False)).name == "utf-8"


def utf8_text() -> None:
    """Where text files would be read as something other than UTF-8, set LC_CTYPE from the
    environment, else to C.UTF-8 (present on every glibc since 2.35 and in Triton's images);
    leaves it as it was where neither gives UTF-8."""
    if _utf8():
        return
    before = locale.setlocale(locale.LC_CTYPE)
    for name in ("", "C.UTF-8", "en_US.UTF-8"):
        try:
            locale.setlocale(locale.LC_CTYPE, name)
        except locale.Error:
            continue
        if _utf8():
            return
    locale.setlocale(locale.LC_CTYPE, before)
