"""The default model's demo adapters: trained in the background into place (never a partial
directory under an adapter's name) and registered by the gateway as they appear."""

from __future__ import annotations

import asyncio
import shutil
from pathlib import Path

from engine.adapter_roots import parse_adapters
from gateway.auth import StateView
from gateway.demo_adapters import (
    RECIPE_FILE,
    TRAINING_LOCK,
    complete_adapters,
    missing_styles,
    remove_stale,
    train_missing,
    watch,
)
from gateway.store import MemoryStore


def test_missing_styles_are_trained_into_place(tiny_model_dir: Path, tmp_path: Path) -> None:
    model = Path(shutil.copytree(tiny_model_dir, tmp_path / "model"))
    (model / "adapters").mkdir()
    (model / "adapters" / ".shout.partial-x").mkdir()  # left by an interrupted run
    assert missing_styles(model / "adapters") == ["shout", "json", "brief"]
    train_missing(model)
    assert sorted(complete_adapters(model / "adapters")) == ["brief", "json", "shout"]
    hidden = [p.name for p in (model / "adapters").iterdir() if p.name.startswith(".")]
    assert hidden == [TRAINING_LOCK]  # no partial work left, only the trainers' lock
    assert sorted(parse_adapters([], str(model / "adapters"))) == ["brief", "json", "shout"]

    # Each records its recipe; one trained by another recipe is removed at the next start.
    assert remove_stale(model / "adapters") == []
    stamp = model / "adapters" / "json" / RECIPE_FILE
    stamp.write_text(stamp.read_text().replace('"steps": ', '"steps": 1'))
    (model / "adapters" / "brief" / RECIPE_FILE).unlink()  # trained before recipes were kept
    assert remove_stale(model / "adapters") == ["brief", "json"]
    assert sorted(p.name for p in (model / "adapters").iterdir()) == [TRAINING_LOCK, "shout"]
    assert missing_styles(model / "adapters") == ["json", "brief"]


def test_the_gateway_registers_each_adapter_as_it_appears(tiny_adapters: dict[str, Path],
                                                          tmp_path: Path) -> None:
    adapter_dir = tmp_path / "adapters"
    adapter_dir.mkdir()
    shutil.copytree(tiny_adapters["a0"], adapter_dir / "shout")
    shutil.copytree(tiny_adapters["a0"], adapter_dir / ".json.partial-1")  # not yet whole

    async def scenario() -> list[list[str]]:
        view = StateView(MemoryStore())
        await view.refresh()
        watcher = asyncio.create_task(watch(adapter_dir, view, interval_s=0.01))
        seen = []
        while sorted(view.snapshot.adapters) != ["shout"]:
            await asyncio.sleep(0.01)
        seen.append(sorted(view.snapshot.adapters))
        (adapter_dir / ".json.partial-1").rename(adapter_dir / "json")
        shutil.copytree(tiny_adapters["a1"], adapter_dir / "brief")
        await asyncio.wait_for(watcher, 10)  # returns once every style is registered
        seen.append(sorted(view.snapshot.adapters))
        assert all(a.owner is None for a in view.snapshot.adapters.values())  # public
        return seen

    assert asyncio.run(scenario()) == [["shout"], ["brief", "json", "shout"]]
