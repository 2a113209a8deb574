"""URLs as messages and logs may show them."""

from __future__ import annotations

import re

# From the ':' after the user name to the LAST '@': a password may hold '/', '?', '#' (SQLAlchemy
# takes them unencoded; redis-py does not, see NodeConfig) and even '@'. Where the path or query
# holds an '@' too, more than the password is hidden: a message loses a little, never a secret.
_PASSWORD = re.compile(r"(://[^:/?#@]*:).*@", re.DOTALL)  # a newline in a password too
_QUERY_PASSWORD = re.compile(r"([?&](?:password|passwd|pwd|sslpassword)=)[^&#]*", re.IGNORECASE)


def shown_url(url: str) -> str:
    """``url`` with any password replaced by ``***`` — in the user info, in a ``password=``
    query parameter (which SQLAlchemy and redis-py both accept) or libpq's ``sslpassword=``.

    Done on the text rather than with SQLAlchemy's ``hide_password`` so that a URL SQLAlchemy
    cannot parse (the case an error message must show) loses its password too."""
    return _QUERY_PASSWORD.sub(r"\1***", _PASSWORD.sub(r"\1***@", url))
