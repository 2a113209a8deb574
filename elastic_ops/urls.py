"""URLs as messages and logs may show them."""

from __future__ import annotations

import re

# From the ':' after the user name to the LAST '@': a password may hold '/', '?', '#' (SQLAlchemy
# and redis-py take them unencoded) and even '@'. Where the path or query holds an '@' too, more
# than the password is hidden: a message loses a little, never a secret.
_PASSWORD = re.compile(r"(://[^:/?#@]*:).*@")
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd)=)[^&#]*", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` — in the user info and in a ``password=``
    query parameter (which SQLAlchemy and redis-py both accept).

    Done on the text rather than with SQLAlchemy's ``hide_password`` so that a URL SQLAlchemy
    cannot parse (the case an error message must show) loses its password too."""
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1***@", url))
