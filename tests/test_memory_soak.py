"""benchmarks/memory_soak.py end to end on the tiny model: a short soak through a real
`loragate serve` completes every kind of request and reads the server's RSS once at the
start and once per --sample-every finished requests."""

from __future__ import annotations

import json
from pathlib import Path

from benchmarks import memory_soak

REQUESTS, EVERY = 60, 20


def test_a_short_soak_fails_nothing_and_samples_every_k_requests(
        tiny_model_dir: Path, tmp_path: Path) -> None:
    out = tmp_path / "soak.json"
    code = memory_soak.main(["--model", str(tiny_model_dir), "--requests", str(REQUESTS),
                             "--concurrency", "2", "--sample-every", str(EVERY),
                             "--out", str(out)])
    result = json.loads(out.read_text())
    assert (code, result["failed"], result["failures"]) == (0, 0, {})
    kinds = len(memory_soak.KINDS)
    assert result["sent"] == {name: len(range(i, REQUESTS, kinds))
                              for i, name in enumerate(memory_soak.KINDS)}
    server = [label for label in result["rss_kb"] if label.startswith("gateway.cli ")]
    assert len(server) == 1
    points = result["rss_kb"][server[0]]
    assert [done for done, *_ in points] == list(range(0, REQUESTS + 1, EVERY))
    assert all(rss == anon + shmem + file and anon > 0
               for _, rss, anon, shmem, file in points)
    for v in result["verdicts"][server[0]].values():
        assert v["verdict"] in ("levels off", "still growing")
