"""The access line: what a request's record says, with the client's own text (the path, the
end user's id) made printable so that no client can forge a line."""

from __future__ import annotations

from gateway.access_log import AccessRecord, access_line


def test_the_line_names_the_end_user_without_letting_it_forge_a_line() -> None:
    record = AccessRecord(start=10.0, tenant="acme", adapter="bot", prompt_tokens=3,
                          completion_tokens=2, first_token_at=10.5, end_user="u 1\nGET / 200")
    line = access_line("POST", "/v1/completions", 200, record, now=11.0)
    assert line == ("POST /v1/completions 200 tenant=acme adapter=bot prompt_tokens=3 "
                    "completion_tokens=2 ttft_ms=500.0 duration_ms=1000.0 "
                    "user=u\\x201\\x0aGET\\x20/\\x20200")
    assert "\n" not in line


def test_a_request_without_an_end_user_has_no_user_field() -> None:
    line = access_line("GET", "/health", 200, AccessRecord(start=0.0), now=0.001)
    assert line == ("GET /health 200 tenant=- adapter=- prompt_tokens=- completion_tokens=- "
                    "ttft_ms=- duration_ms=1.0")
