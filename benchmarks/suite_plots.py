"""PNG plots of a suite run (matplotlib, headless): one figure per benchmark report."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import matplotlib

matplotlib.use("Agg")  # no display on servers and CI
import matplotlib.pyplot as plt
from matplotlib.axes import Axes


def _bars(ax: Axes, labels: list[str], values: list[float], ylabel: str, title: str) -> None:
    ax.bar(range(len(values)), values, color="#4C72B0")
    ax.set_xticks(range(len(values)), labels, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize=10)


def _throughput(r: dict[str, Any], ax: Axes) -> None:
    _bars(ax, ["transformers static", "loragate engine"],
          [r["transformers"]["output_tokens_per_s"], r["engine"]["output_tokens_per_s"]],
          "output tokens/s", f"engine vs static batching ({r['throughput_ratio']:.2f}x)")


def _prefix(r: dict[str, Any], ax: Axes) -> None:
    rows = [x for x in r["results"] if x["phase"] in ("throughput", "warm throughput")]
    _bars(ax, [f"{'wide ' if x.get('model') == 'wide' else ''}{x['layout']} {x['mode']}"
               f"{' warm' if x['phase'].startswith('warm') else ''}" for x in rows],
          [x["throughput_rps"] for x in rows], "requests/s (all at once)",
          "RAG prefix caching: capacity by mode")


def _lora(r: dict[str, Any], ax: Axes) -> None:
    runs = r["engine_runs"]
    labels = [run["label"] for run in runs] + ["PEFT per-adapter"]
    values = [run["output_tokens_per_s"] for run in runs] + [
        r["peft_baseline"]["output_tokens_per_s"]]
    _bars(ax, labels, values, "output tokens/s", "adapter count sweep")


def _interference(r: dict[str, Any], ax: Axes) -> None:
    labels = ["on" if x["chunked_prefill"] else "off" for x in r["results"]]
    ax.bar([i - 0.2 for i in range(2)], [x["itl_p50_ms"] for x in r["results"]], 0.4,
           label="p50")
    ax.bar([i + 0.2 for i in range(2)], [x["itl_p99_ms"] for x in r["results"]], 0.4,
           label="p99")
    ax.set_xticks(range(2), [f"chunked prefill {x}" for x in labels])
    ax.set_ylabel("decode ITL (ms)")
    ax.set_title(f"interference: p99 off/on {r['p99_ratio_off_over_on']:.2f}x", fontsize=10)
    ax.legend()


def _rate(r: dict[str, Any], ax: Axes) -> None:
    rows = r["rows"]
    rates = [x["rate"] for x in rows]
    ax.plot(rates, [x["normalized_latency_p50_ms_per_token"] for x in rows], "o-",
            label="normalized latency p50 (ms/token)")
    ax.set_xlabel("request rate (req/s)")
    ax.set_ylabel("ms / output token")
    twin = ax.twinx()
    twin.plot(rates, [x["goodput"] or 0.0 for x in rows], "s--", color="#DD8452",
              label="goodput (req/s)")
    twin.set_ylabel("goodput (req/s)")
    ax.set_title("request-rate sweep through the gateway", fontsize=10)


def _gateway_overhead(overhead: dict[str, Any], ax: Axes) -> None:
    """TTFT p50 direct vs through the gateway, one at a time and under load."""
    alone = overhead["one_at_a_time"]["ttft_p50_ms"]
    pooled = overhead["pooled"]
    for offset, path in ((-0.2, "direct"), (0.2, "gateway")):
        ax.bar([offset, 1 + offset], [alone[path], pooled[path]["ttft_p50_ms"]], 0.4,
               label=path)
    ax.set_xticks(range(2), ["one at a time", "under load"])
    ax.set_ylabel("TTFT p50 (ms)")
    ax.set_title("gateway overhead: direct vs through the gateway", fontsize=10)
    ax.legend()


def _gateway(r: dict[str, Any], ax: Axes) -> None:
    if "routing" not in r:
        _gateway_overhead(r["overhead"], ax)
        return
    routing = r.get("routing", {})
    runs = routing.get("runs", [])
    conversations = routing.get("conversations", {}).get("runs", [])
    labels = [f"{x['instances']}x {x['policy']}, {x.get('kv_blocks', '?')} blk" for x in runs]
    labels += [f"chat 2x {x['policy']}, {x.get('kv_blocks', '?')} blk" for x in conversations]
    runs = runs + conversations
    _bars(ax, labels,
          [x.get("prefix_hit_rate", 0.0) for x in runs], "prefix hit rate",
          "routing: hit rate by policy")


def _tenancy(r: dict[str, Any], ax: Axes) -> None:
    names = list(r["stats"])
    _bars(ax, names, [r["stats"][n]["p50_ms"] for n in names], "E2E p50 (ms)",
          "gateway: open vs auth + limits (memory, Redis)")


def _peer_ratios(r: dict[str, Any]) -> list[tuple[str, float, float | None]]:
    """(label, loragate / vLLM ratio, target) per offline workload and serving rate, as the
    peers report wrote them (each entry carries its own ratio and target)."""
    bars = [(f"{t['workload']} throughput (higher better)", t["ratio"], t.get("target"))
            for t in r.get("throughput") or []]
    bars += [(f"TTFT p50 @ {row['rate']:g}/s (lower better)", row["ttft_p50_ratio"],
              row.get("target")) for row in (r.get("serving") or {}).get("rows", [])]
    return bars


def _peers(r: dict[str, Any], ax: Axes) -> None:
    bars = _peer_ratios(r)
    if not bars:  # an agreement-only run has no ratio to draw
        raise ValueError("no throughput or serving figures")
    labels, ratios, targets = zip(*bars, strict=True)
    y = list(range(len(bars)))
    ax.barh(y, ratios, color="#4C72B0")
    ax.set_yticks(y, labels, fontsize=8)
    ax.invert_yaxis()  # the report's order, top to bottom
    ax.axvline(1.0, color="grey", linestyle="--", linewidth=1, label="parity")
    marked = [(t, i) for i, t in enumerate(targets) if t is not None]
    ax.scatter([t for t, _ in marked], [i for _, i in marked], marker="|", s=400,
               linewidths=2.5, color="#C44E52", zorder=3, label="target")
    ax.set_xlim(0, 1.35 * max(1.0, *ratios, *(t for t, _ in marked)))  # room for the legend
    ax.set_xlabel("loragate / vLLM")
    ax.set_title("side by side with vLLM's CPU build", fontsize=10)
    ax.legend(fontsize=8, loc="upper right")


PLOTTERS: dict[str, Callable[[dict[str, Any], Axes], None]] = {
    "throughput": _throughput, "prefix": _prefix, "lora": _lora,
    "interference": _interference, "rate": _rate, "gateway": _gateway, "tenancy": _tenancy,
    "peers": _peers}


def draw_plots(reports: dict[str, dict[str, Any]], out_dir: Path) -> list[Path]:
    """One PNG per report that has a plotter; returns the paths written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    written = []
    for name, report in reports.items():
        figure, ax = plt.subplots(figsize=(6, 3.6))
        try:
            PLOTTERS[name](report, ax)
        except (KeyError, TypeError, ValueError, IndexError):
            plt.close(figure)
            continue
        figure.tight_layout()
        path = out_dir / f"{name}.png"
        figure.savefig(path, dpi=110)
        plt.close(figure)
        written.append(path)
    return written
