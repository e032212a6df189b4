"""What the gateway reveals, and to whom: the operator endpoints, instance ids, Host names.

- /instances and /metrics describe every tenant's adapters and the engines' URLs: they need
  the admin key (or, for /metrics, the metrics token) as soon as an admin key is set or
  tenants exist. Only the open mode (no admin key, no tenants: a loopback toy) leaves them
  open, and a metrics token, once set, always guards /metrics.
- Responses name the instance that served them by an opaque id, never by its URL:
  ``instance_tag(url, admin_key)`` is an HMAC of the URL under a key stretched (scrypt) from
  the admin key, so every replica with the same admin key gives an instance the same id, and
  a client cannot brute-force an internal address (or the admin key) back out of it. Without
  an admin key the key is a constant (the open mode has no tenants to keep apart; replicas
  that serve tenants should hold the admin key). /instances maps ids to URLs for the
  operator.
- The open mode answers only requests addressed to a loopback name (or to an allowed
  host): a web page on another origin that rebinds its DNS name to 127.0.0.1 sends its own
  name in Host and is refused, so it cannot drive a keyless gateway from a browser.
"""

from __future__ import annotations

import functools
import hashlib
import hmac

from fastapi import Request

from engine.http.auth import is_loopback
from engine.http.errors import ApiError
from gateway.auth import bearer

TAG_SALT = b"loragate-instance-tag"


@functools.lru_cache(maxsize=4)
def _tag_key(secret: str | None) -> bytes:
    """~50 ms of scrypt, once per process: guessing the secret offline from ids is slow."""
    if not secret:
        return TAG_SALT
    return hashlib.scrypt(secret.encode(), salt=TAG_SALT, n=1 << 14, r=8, p=1, dklen=32)


def instance_tag(url: str, secret: str | None = None) -> str:
    """The opaque id of the instance at url: "instance-" and 12 hex digits."""
    digest = hmac.new(_tag_key(secret), url.rstrip("/").encode(), hashlib.sha256).hexdigest()
    return f"instance-{digest[:12]}"


def operator_endpoints_open(admin_key: str | None, open_mode: bool) -> bool:
    """/instances (and /metrics without a metrics token) need no key: the open mode."""
    return not admin_key and open_mode


def require_operator(request: Request, admin_key: str | None,
                     metrics_token: str | None = None) -> None:
    """The admin key, or metrics_token when given (the /metrics route passes it): else 401,
    or 403 when the gateway holds neither secret (tenants exist but no admin key is set)."""
    key = bearer(request)
    for secret in (admin_key, metrics_token):
        if secret and key and hmac.compare_digest(key.encode(), secret.encode()):
            return
    accepted = "the admin key" + (" or the metrics token" if metrics_token else "")
    if not admin_key and not metrics_token:
        raise ApiError(403, "this endpoint is disabled: tenants exist and the gateway has no "
                       "admin key (start it with --admin-key or LORAGATE_ADMIN_KEY)",
                       code="admin_disabled")
    raise ApiError(401, f"this endpoint needs {accepted}: send 'Authorization: Bearer <key>'",
                   code="invalid_api_key")


def host_name(header: str) -> str:
    """The host of a Host header: lower case, without port, IPv6 without brackets."""
    header = header.strip().lower()
    if header.startswith("["):
        return header[1:].partition("]")[0]
    name, sep, port = header.rpartition(":")
    host = name if sep and port.isdigit() and ":" not in name else header
    return host.rstrip(".")  # "localhost." is "localhost"




def host_allowed(header: str | None, allowed: tuple[str, ...]) -> bool:
    """Whether a request with this Host header may be answered under a Host restriction:
    loopback names always, else an entry of allowed ("*.example.com": any subdomain of
    example.com; "*": any host). A missing Host header is refused."""
    if not header:
        return False
    host = host_name(header)
    if is_loopback(host):
        return True
    for entry in allowed:
        entry = entry.lower()
        if entry == "*" or entry == host or (
                entry.startswith("*.") and host.endswith(entry[1:])):
            return True
    return False
