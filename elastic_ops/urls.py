"""URLs as messages and logs may show them."""

from __future__ import annotations

import re

_PASSWORD = re.compile(r"(//[^/?#@]*?:)[^/?#]*@")


def shown_url(url: str) -> str:
    """``url`` with any password replaced by ``***``.

    Done on the text rather than with SQLAlchemy's ``hide_password`` so that a URL SQLAlchemy
    cannot parse (the case an error message must show) loses its password too."""
    return _PASSWORD.sub(r"\1***@", url)
