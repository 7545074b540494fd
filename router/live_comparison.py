"""The live figures beside the simulated ones: what is compared and its
goals (:data:`METRICS`), each live router's figures (:func:`live_figures`),
the per-arm comparison with its rankings and the pairs the live rounds
separate (:func:`compare`), and the Markdown table printed."""

from __future__ import annotations

import statistics

GOALS = {"hit": 0.02, "ttft_p50": 0.25, "ttft_p99": 0.40}  # absolute; relative; relative

# (figure, label, goal kind, goal): "abs" = |sim - live| <= goal; "rel" = |sim / live - 1| <= goal
METRICS = (
    ("hit", "hit rate", "abs", GOALS["hit"]),
    ("ttft_p50", "TTFT p50 s", "rel", GOALS["ttft_p50"]),
    ("ttft_p99", "TTFT p99 s", "rel", GOALS["ttft_p99"]),
    ("ttft_p99_rounds", "TTFT p99 s, median round", "rel", GOALS["ttft_p99"]),
    ("engine_ttft_p50", "engine TTFT p50 s", "rel", GOALS["ttft_p50"]),
    ("engine_ttft_p99_rounds", "engine TTFT p99 s, median round", "rel", GOALS["ttft_p99"]),
    ("imbalance", "imbalance", None, None),
    # the simulator's own measure (max / mean busy time); live, each Worker's request spans as the client saw them
    ("busy_imbalance", "busy imbalance", None, None),
)


def live_figures(report: dict) -> dict[str, dict]:
    """Per live router: hit rate, TTFT p50/p99, imbalance, and the measured ingress and engine TTFTs."""
    figures = {}
    for router, result in report["results"].items():
        figures[router] = {
            "hit": result["cluster_hit_rate"],
            "ttft_p50": result["ttft_s"]["p50"],
            "ttft_p99": result["ttft_s"]["p99"],
            "imbalance": result["load_imbalance"],
            "busy_imbalance": result.get("busy_imbalance"),  # None in reports from before it was measured
            "ingress_p50": (result.get("ingress_overhead_s") or {}).get("p50"),
            "engine_ttft_p50": (result.get("server_ttft_s") or {}).get("p50"),
            "engine_ttft_p99": (result.get("server_ttft_s") or {}).get("p99"),
            "ttft_p99_rounds": _median_of_rounds(result, "ttft_s"),
            "engine_ttft_p99_rounds": _median_of_rounds(result, "server_ttft_s"),
            "load_average": [r.get("load_average") for r in result.get("rounds", [])],
            "rounds": {key: [v for v in (_round_value(r, key) for r in result.get("rounds", [])) if v is not None]
                       for key, *_ in METRICS},
        }
    return figures


def _round_value(round_: dict, key: str) -> float | None:
    """One round's value of a compared figure (its p99 stands for the pooled and the median-round p99)."""
    picks = {"hit": ("cluster_hit_rate", None), "imbalance": ("load_imbalance", None),
             "busy_imbalance": ("busy_imbalance", None),
             "ttft_p50": ("ttft_s", "p50"), "ttft_p99": ("ttft_s", "p99"), "ttft_p99_rounds": ("ttft_s", "p99"),
             "engine_ttft_p50": ("server_ttft_s", "p50"), "engine_ttft_p99_rounds": ("server_ttft_s", "p99")}
    name, quantile = picks[key]
    value = round_.get(name)
    return value.get(quantile) if quantile and isinstance(value, dict) else value


def _median_of_rounds(result: dict, key: str) -> float | None:
    """The median over rounds of each round's p99 (a stall in one round moves the pooled p99 alone)."""
    values = [r[key]["p99"] for r in result.get("rounds", []) if (r.get(key) or {}).get("p99") is not None]
    return statistics.median(values) if values else None


def ranking(figures: dict[str, dict], key: str) -> list[str]:
    """Routers best first: higher hit rate, lower TTFT and imbalance."""
    sign = -1 if key == "hit" else 1
    return sorted(figures, key=lambda r: sign * figures[r][key])


def compare(live: dict[str, dict], sim: dict[str, dict]) -> dict:
    """Per arm (the labels both sides have) and figure: live, sim, the
    difference or ratio, whether the goal is met; and the rankings. A
    simulated run has no rounds: its p99 stands beside both the live pooled
    p99 and the median round's."""
    labels = [label for label in live if label in sim]
    rows = {}
    for label in labels:
        lv, sm = live[label], dict(sim[label])
        sm.setdefault("ttft_p99_rounds", sm["ttft_p99"])
        sm.setdefault("engine_ttft_p99_rounds", sm.get("engine_ttft_p99"))
        row = {}
        for key, _, kind, goal in METRICS:
            if lv.get(key) is None or sm.get(key) is None:
                continue
            cell = {"live": lv[key], "sim": sm[key]}
            if kind == "abs":
                cell["diff"] = sm[key] - lv[key]
                cell["met"] = abs(cell["diff"]) <= goal
            elif kind == "rel":
                cell["ratio"] = sm[key] / lv[key]
                cell["met"] = abs(cell["ratio"] - 1) <= goal
            row[key] = cell
        rows[label] = row
    keys = [key for key, *_ in METRICS if all(key in rows[r] for r in labels)]
    ranks = {}
    for key in keys:
        ranks[key] = {"live": ranking({r: {key: rows[r][key]["live"]} for r in labels}, key),
                      "sim": ranking({r: {key: rows[r][key]["sim"]} for r in labels}, key)}
        ranks[key]["same"] = ranks[key]["live"] == ranks[key]["sim"]
        separated = separated_pairs({r: live[r].get("rounds", {}).get(key, []) for r in labels}, key)
        sim_better = (lambda a, b: a > b) if key == "hit" else (lambda a, b: a < b)
        ranks[key]["separated"] = separated
        ranks[key]["contradicted"] = [(a, b) for a, b in separated
                                      if not sim_better(rows[a][key]["sim"], rows[b][key]["sim"])]
    return {"rows": rows, "rankings": ranks}


def separated_pairs(live_rounds: dict[str, list[float]], key: str) -> list[tuple[str, str]]:
    """``(a, b)`` where the live run orders a before b beyond its own noise:
    every round of a better than every round of b. Pairs whose rounds
    overlap are ties the live run does not rank; the simulator must keep the
    order of the separated pairs (a pair it ties or reverses is contradicted)."""
    better = (lambda a, b: a > b) if key == "hit" else (lambda a, b: a < b)
    out = []
    for a in live_rounds:
        for b in live_rounds:
            if a == b or not live_rounds[a] or not live_rounds[b]:
                continue
            worst_a = min(live_rounds[a]) if key == "hit" else max(live_rounds[a])
            best_b = max(live_rounds[b]) if key == "hit" else min(live_rounds[b])
            if better(worst_a, best_b):
                out.append((a, b))
    return out


def print_markdown(workload: str, comparison: dict, ingress_s: float, slowdown: float, drawn: bool) -> None:
    ingress = "a draw from the live per-request ingress times" if drawn else "the live median ingress"
    print(f"{workload} (engine steps x{slowdown:.2f} the profile's; sessions' next turns "
          f"{ingress_s * 1e3:.1f} ms after a completion; simulated client TTFT = engine TTFT + {ingress}). "
          f"Each cell: live / sim (difference or ratio); ✗: outside the goal\n")
    keys = [m for m in METRICS if all(m[0] in row for row in comparison["rows"].values())]
    print("| router | " + " | ".join(label for _, label, *_ in keys) + " |")
    print("|---|" + "---|" * len(keys))
    for router, row in comparison["rows"].items():
        cells = []
        for key, _, kind, _ in keys:
            cell = row[key]
            text = f"{cell['live']:.3f} / {cell['sim']:.3f}"
            if kind == "abs":
                text += f" ({cell['diff']:+.3f})"
            elif kind == "rel":
                text += f" ({cell['ratio']:.2f})"
            cells.append(text + ("" if cell.get("met", True) else " ✗"))
        print(f"| {router} | " + " | ".join(cells) + " |")
    print()
    for key, rank in comparison["rankings"].items():
        verdict = "same order" if rank["same"] else "another order"
        separated = ", ".join(f"{a} > {b}" for a, b in rank["separated"]) or "none"
        against = ", ".join(f"{a} > {b}" for a, b in rank["contradicted"]) or "none"
        print(f"- {key}: live {' > '.join(rank['live'])}; sim {' > '.join(rank['sim'])} ({verdict}). "
              f"Separated in every live round: {separated}; of those the sim reverses: {against}")
