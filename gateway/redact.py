"""Credentials out of URLs and error text before they are logged or shown to anyone.

A Redis URL carries its password (``redis://:PASSWORD@host`` or ``?password=``); anything
that prints a store URL, or an error that may quote one, goes through here first.
"""

from __future__ import annotations

import re
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

HIDDEN = "***"
_SECRET_PARAMS = ("password", "username", "user", "pass", "token")
_USERINFO = re.compile(r"(\b[A-Za-z][A-Za-z0-9+.-]*://)[^/\s@]*@")
_PARAM = re.compile(r"\b(" + "|".join(_SECRET_PARAMS) + r")=[^&\s]*", re.IGNORECASE)


def redact_url(url: str) -> str:
    """The URL without its user info (replaced by ***) or credential query parameters."""
    try:
        parts = urlsplit(url)
        host = parts.netloc.rpartition("@")[2]
    except ValueError:
        return redact_text(url)
    netloc = f"{HIDDEN}@{host}" if "@" in parts.netloc else host
    query = urlencode([(k, HIDDEN if k.lower() in _SECRET_PARAMS else v)
                       for k, v in parse_qsl(parts.query, keep_blank_values=True)],
                      safe="*")
    return urlunsplit((parts.scheme, netloc, parts.path, query, parts.fragment))


def redact_text(text: str) -> str:
    """Free text (an exception message) with every URL's user info and every
    password=/token= value replaced by ***."""
    return _PARAM.sub(rf"\1={HIDDEN}", _USERINFO.sub(rf"\1{HIDDEN}@", text))
