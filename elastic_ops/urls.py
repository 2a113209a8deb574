"""URLs as messages and logs may show them."""

from __future__ import annotations

import re
from urllib.parse import unquote

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


def secrets_of(url: str) -> list[str]:
    """The texts of ``url`` that a driver's message must not show: its password as written (from
    the ':' after the user name to the last '@'), each part of it between '@'s of 3 or more
    characters (a parser that stops at the first '@' takes the rest for the host, and says so in
    its errors), each also percent-decoded, and ``password=`` query values. Longest first."""
    found: list[str] = []
    m = _PASSWORD.search(url)
    if m is not None:
        secret = url[m.end(1):m.end() - 1]
        found += [secret, *(part for part in secret.split("@") if len(part) >= 3)]
    found += [unquote(s) for s in found]  # percent-encoded in the URL, decoded in a message
    found += [v for v in re.findall(r"[?&](?:password|passwd|pwd|sslpassword)=([^&#]*)", url, re.IGNORECASE)
              if v]
    return sorted({s for s in found if s}, key=len, reverse=True)


def scrubbed(text: str, url: str) -> str:
    """``text`` (a driver's or library's message about ``url``) with every secret of ``url``
    (:func:`secrets_of`) replaced by ``***``."""
    for secret in secrets_of(url):
        text = text.replace(secret, "***")
    return text
