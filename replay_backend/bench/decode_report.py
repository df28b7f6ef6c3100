"""The decode bench's report (bench/decode.py) as markdown tables."""
from __future__ import annotations


def render(report: dict) -> str:
    """The report as markdown tables: TPOT and floors, the mixed and prefill points,
    capture cost."""
    res = [r for r in report["results"] if not r["error"]]
    base = next((r for r in res if r["mode"] == "piecewise"), None)
    full = next((r for r in res if r["mode"] == "full_and_piecewise"), None)
    ratio = base is not None and full is not None  # its column, where both modes ran
    lines = [f"decode steps, {report['preset']} on {report['device']} (torch {report['torch']}), median of "
             f"{report['steps']} steps", "", "| context/conc | " + " | ".join(
                 f"{r['mode']} ms (floor, x floor)" for r in res) + (" | piecewise / full_and_piecewise" * ratio)
             + " |", "|---|" + "---|" * (len(res) + ratio)]
    queued = ["", "steps queued back to back (one sync at the end), ms per step; and inside a step's time, "
              "the host's ms building its batch and until the step was queued (build and launches)", "",
              "| context/conc | " + " | ".join(f"{r['mode']} queued | build | host" for r in res) + " |",
              "|---|" + "---|" * 3 * len(res)]
    for point in (base or res[0])["tpot_ms"] if res else []:
        cells = []
        for r in res:
            ms, floor = r["tpot_ms"].get(point), r["floor_ms"].get(point)
            cells.append("-" if ms is None else f"{ms:.2f}" + (f" ({floor:.2f}, {ms / floor:.2f}x)" if floor else ""))
        if ratio:
            cells.append(f"{base['tpot_ms'][point] / full['tpot_ms'][point]:.2f}x" if point in full["tpot_ms"] else "-")
        lines.append(f"| {point} | " + " | ".join(cells) + " |")
        queued.append(f"| {point} | " + " | ".join(" | ".join(f"{r[k].get(point, float('nan')):.2f}" for k in
                                                              ("pipelined_ms", "build_ms", "host_ms"))
                                                   for r in res) + " |")
    lines += queued
    for title, key in (("mixed step, tokens", "mixed_ms"), ("prefill TTFT c1, ISL", "ttft_ms")):
        lines += ["", f"| {title} | " + " | ".join(f"{r['mode']} ms" for r in res) + " |",
                  "|---|" + "---|" * len(res)]
        for point in (base or res[0])[key] if res else []:
            lines.append(f"| {point} | " + " | ".join(f"{r[key].get(point, float('nan')):.2f}" for r in res) + " |")
    lines += ["", "| mode | build s | capture: level graphs / s / GiB |", "|---|---|---|"]
    for r in report["results"]:
        cap = "; ".join(f"{lvl} {c['graphs']} / {c['seconds']:.1f} / {c['gib']:.2f}" for lvl, c in r["capture"].items())
        lines.append(f"| {r['mode']} | {r['build_s']:.0f} | {cap or r['error'] or '-'} |")
    missing = [f"- {r['mode']} {point}: {why}" for r in res for point, why in r.get("floor_errors", {}).items()]
    if missing:
        lines += ["", "NO FLOOR where the table shows none (the mode's times stand):", *missing]
    return "\n".join(lines)
