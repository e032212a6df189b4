"""The route label of a response's metrics: its route's template, never the raw path.

A request the router handled carries its route in the scope. One refused before routing
(by Guard: a wrong Host, an oversized or compressed body, a draining gateway, an unknown
key) does not, so its template is found by matching the app's route templates against its
method and path, as the router would have. Labels stay bounded: a path no route matches is
"unmatched".
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import fastapi.routing
from starlette.routing import BaseRoute, compile_path
from starlette.types import Scope

UNMATCHED = "unmatched"
_CONVERTER = re.compile(r"\{(\w+):\w+\}")


def template(path: str) -> str:
    """A route path without its converters: "/v1/models/{model_id}", not "{model_id:path}"."""
    return _CONVERTER.sub(r"{\1}", path)


@dataclass(frozen=True)
class _Template:
    pattern: re.Pattern[str]
    methods: frozenset[str]
    label: str


class RouteLabels:
    """Labels for one app's requests; routes() lists its routes (read once, at the first
    refusal: every route is in place by the time a request can arrive)."""

    def __init__(self, routes: Callable[[], Sequence[BaseRoute]]) -> None:
        self._routes = routes
        self._templates: list[_Template] | None = None

    def __call__(self, scope: Scope) -> str:
        path = getattr(scope.get("route"), "path", None)
        if isinstance(path, str):
            return template(path)
        method, request_path = scope.get("method", ""), scope.get("path", "")
        allowed = None
        for candidate in self._table():
            if candidate.pattern.match(request_path):
                if method in candidate.methods:
                    return candidate.label
                allowed = allowed or candidate.label  # the path's route; not its method
        return allowed or UNMATCHED

    def _table(self) -> list[_Template]:
        if self._templates is None:
            # FastAPI 0.16x keeps an included router as one entry; its route contexts list
            # the routes inside with their full paths (older versions flatten on include).
            flatten = getattr(fastapi.routing, "iter_route_contexts", None)
            routes = list(flatten(self._routes()) if flatten else self._routes())
            self._templates = [
                _Template(compile_path(route.path)[0], frozenset(route.methods),
                          template(route.path))
                for route in routes
                if isinstance(getattr(route, "path", None), str)
                and getattr(route, "methods", None)]
        return self._templates
