"""The benchmark report as text: per capture setting, a table of each mode's step time,
the floor and replay's speed-ups, then compile, capture, memory and trim-op host time."""
from __future__ import annotations

MODES = ("eager", "off", "parent", "piecewise", "replay", "reduce-overhead")
# Modes without this backend's graphs: a capture setting changes nothing in them, so they
# run once, at the default setting, and every setting's table shows that run.
UNGRAPHED = ("eager", "off", "parent", "reduce-overhead")


def _fmt(value, spec: str) -> str:
    return "-" if value is None else spec.format(value)


# A point's first run costs up to about 1.6x its median where nothing is built in it
# (the allocator and caches warming); a Triton build inside a step costs about a
# second. Both bounds, so that short points' noise is not flagged.
FIRST_RUN_FACTOR = 3.0
FIRST_RUN_MIN_EXTRA_MS = 100.0


def slow_first_runs(report: dict) -> list[tuple[str, str, float, float]]:
    """``(setting/mode, point, first ms, median ms)`` for every point whose first run took
    over FIRST_RUN_FACTOR times its median and FIRST_RUN_MIN_EXTRA_MS more."""
    out = []
    for r in report["results"]:
        for point, first in (r.get("first_ms") or {}).items():
            median = r["ms"].get(point)
            if median and first > FIRST_RUN_FACTOR * median and first - median > FIRST_RUN_MIN_EXTRA_MS:
                out.append((f"{r['setting']}/{r['mode']}", point, first, median))
    return out


def _mfu_table(report: dict, setting: str, by: dict, modes: list[str], rows) -> list[str]:
    """Each mode's and the floor's model-FLOPs utilisation at this setting: the point's
    model FLOPs (bench/flops.py) over its time, over the measured dense matmul rate."""
    peak, gflop = report.get("peak_tflops"), report.get("point_gflop") or {}
    if not peak or not gflop:
        return []
    lines = [f"\nmodel FLOPs utilisation at {setting} (% of the measured {peak:.3g} TFLOP/s):\n",
             "| ISL/conc | GFLOP | " + " | ".join(modes) + " | floor |", "|" + "---|" * (len(modes) + 3)]
    for key in sorted(rows, key=lambda k: tuple(int(x) for x in k.split("/"))):
        def mfu(ms):
            return _fmt(gflop[key] / (ms / 1e3) / (peak * 1e3) * 100 if ms and key in gflop else None, "{:.1f}")

        cells = [mfu((by.get((setting, m)) or by.get(("default", m)) or {"ms": {}})["ms"].get(key)) for m in modes]
        cells.append(mfu(report["floor_ms"].get(setting, {}).get(key)))
        lines.append(f"| {key} | {_fmt(gflop.get(key), '{:.1f}')} | " + " | ".join(cells) + " |")
    return lines


# A rank's floor this far from rank 0's is listed under the table.
FLOOR_SPREAD = 0.02


def topology_name(topo: dict) -> str:
    return (f"TP{topo['tp']} x DP{topo['dp']}" + (" expert-parallel" if topo["enable_expert_parallel"] else "")
            + f", {topo['world']} rank{'s' if topo['world'] > 1 else ''}")


def _other_floors(report: dict) -> list[str]:
    """Each other rank's floors where they differ from rank 0's (FLOOR_SPREAD)."""
    every = report.get("floor_ms_by_rank") or []
    lines = []
    for rank, floors in enumerate(every[1:], start=1):
        for setting, points in sorted((floors or {}).items()):
            mine = report["floor_ms"].get(setting, {})
            far = [f"{p} {ms:.1f}" for p, ms in points.items()
                   if mine.get(p) is None or abs(ms - mine[p]) > FLOOR_SPREAD * mine[p]]
            if far:
                lines.append(f"- rank {rank} {setting}: " + ", ".join(far))
    if lines:
        lines.insert(0, f"\nfloor ms of the other ranks, where more than {FLOOR_SPREAD:.0%} from rank 0's "
                        "(the table's):")
    return lines


def render(report: dict) -> str:
    opts = " ".join(report.get("model_options") or [])
    topo = report.get("topology")
    lines = [f"# {report['preset']}{' (' + opts + ')' if opts else ''} {report['dtype']} on {report['device']} (torch {report['torch']}), "
             + (f"{topology_name(topo)} (rank 0's times), " if topo else "")
             + f"median of {report['runs']} after {report['warmup']} warm-up, "
             f"max_num_batched_tokens {report['max_num_batched_tokens']}"]
    drift = [f"{r['setting']}/{r['mode']}" for r in report["results"] if r.get("drifted")]
    if drift:
        lines.append(f"\nWARNING: the logits of {', '.join(drift)} drift from the model (beyond the rounding "
                     "noise around its fp32 copy): their times are not results")
    late = [f"{r['setting']}/{r['mode']}" for r in report["results"] if r.get("after_profiler")]
    if late:
        lines.append(f"\nNOTE: {', '.join(late)} timed after a profiler session of this process, which slows every "
                     "later CUDA launch on the host (a graph's most): their host-bound points, and a later pass's "
                     "build and capture, read slow. Time them in a process of their own to compare "
                     "(docs/benchmarks.md, How it measures)")
    by = {(r["setting"], r["mode"]): r for r in report["results"]}
    graphed = {s for (s, m) in by if m not in UNGRAPHED}
    for setting in ("default", "wide"):
        if setting not in graphed and (graphed or setting != "default"):
            continue  # only the ungraphed modes ran here: they are in another table
        rows = {k for (s, _), r in by.items() if s in (setting, "default") for k in r["ms"]}
        if not rows:
            continue
        modes = [m for m in MODES if (setting, m) in by or (setting == "wide" and ("default", m) in by)]
        ratios = "replay" in modes  # without it, only the times: no ratio has a numerator
        others = [m for m in modes if m != "replay"]
        lines.append(f"\n## capture setting: {setting}\n")
        head = "| ISL/conc | " + " | ".join(f"{m} ms" for m in modes) + " |" + (
            " floor ms | " + "".join(f"replay speed-up vs {m} | " for m in others) + "replay / floor |"
            if ratios else "")
        lines += [head, "|" + "---|" * (head.count("|") - 1)]
        for key in sorted(rows, key=lambda k: tuple(int(x) for x in k.split("/"))):
            def ms(m):
                r = by.get((setting, m)) or by.get(("default", m))
                return r["ms"].get(key) if r else None

            cells = [_fmt(ms(m), "{:.1f}") for m in modes]
            if ratios:
                rep = ms("replay")
                floor = report["floor_ms"].get(setting, {}).get(key)
                cells.append(_fmt(floor, "{:.1f}"))
                cells += [_fmt(ms(m) / rep if ms(m) and rep else None, "{:.2f}x") for m in others]
                cells.append(_fmt(rep / floor if rep and floor else None, "{:.2f}"))
            lines.append(f"| {key} | " + " | ".join(cells) + " |")
        lines += _mfu_table(report, setting, by, modes, rows)
    lines += _other_floors(report)
    if report.get("agree_us_median") is not None:
        lines.append(f"\nper-step agreement of the data-parallel ranks (one small gloo all-reduce): "
                     f"median {report['agree_us_median']:.1f} us")
    probes = report.get("host_probe") or {}
    if probes:
        lines.append("\nhost speed (small CPU op / tiny CUDA launch, us per call): " + ", ".join(
            f"{when} {p['cpu_op_us']:.2f} / {_fmt(p.get('cuda_launch_us'), '{:.2f}')}" for when, p in probes.items())
            + " of the timed points")
    if report.get("trace_s") is not None:
        lines.append(f"\nDynamo trace, once for every mode of this backend: {report['trace_s']:.1f} s")
    lines.append("\nbuild (split + compile pieces; the first built compiles, the others reuse "
                 "identical pieces) and capture per mode:")
    if report.get("drift_limit") is not None:
        lines.append(f"(logits of a {report['check_tokens']}-token prompt, relative L2 to the model's fp32 copy: "
                     f"plain model {report['plain_err_vs_fp32']:.3g}, fp32 copies nudged by one rounding "
                     f"{report['noise_err_vs_fp32']:.3g}; a mode drifts above {report['drift_limit']:.3g})")
    for r in report["results"]:
        cap = ", ".join(f"{k}: {v['graphs']} graphs over {v['sizes']} sizes, {v['seconds']:.1f} s, "
                        f"{v['gib']:.2f} GiB" for k, v in (r["capture"] or {}).items())
        est = r.get("memory_estimate_gib")
        split = r.get("split_warmup_s")
        err = r.get("max_abs_err_vs_eager")
        err32 = r.get("rel_err_vs_fp32")
        what = "trace + compile" if r["mode"] == "reduce-overhead" else "build"
        lines.append(f"- {r['setting']}/{r['mode']}: {what} {r['compile_s']:.1f} s; {cap or 'no graphs'}"
                     + (f" (after the attention's split warm-up step, {split:.1f} s)" if split is not None else "")
                     + (f"; logits vs eager max|d| {err:.3g}" if err is not None else "")
                     + (f", rel L2 vs the fp32 copy {err32:.3g}" if err32 is not None else "")
                     + ("; DRIFT: beyond the rounding noise" if r.get("drifted") else "")
                     + (f"; estimated graph memory {est:.2f} GiB" if est is not None else "")
                     + (f"; ERROR {r['error']}" if r["error"] else ""))
    lost = [(f"{r['setting']}/{r['mode']}", point, why) for r in report["results"]
            for point, why in (r.get("floor_errors") or {}).items()]
    if lost:
        lines.append("\nNO FLOOR where the table shows none (a profiler session that recorded no kernels):")
        lines += [f"- {who} {point}: {why}" for who, point, why in lost]
    slow = slow_first_runs(report)
    if slow:
        lines.append(f"\nFIRST RUNS over {FIRST_RUN_FACTOR:g}x their point's median (one-time work inside served "
                     "steps, such as a Triton build: docs/debugging.md, A slow first step after capture):")
        lines += [f"- {who} {point}: {first:.1f} ms, median {median:.1f} ms" for who, point, first, median in slow]
    events = [(f"{r['setting']}/{r['mode']}", point, moved) for r in report["results"]
              for point, moved in (r.get("events") or {}).items()]
    if events:
        lines.append("\nEVENTS in timed runs (counters a served step should not move: fallbacks, captures, "
                     "recompiles, copies of the trim rows; docs/debugging.md, Counters):")
        lines += [f"- {who} {point}: " + ", ".join(f"{k} +{v}" for k, v in moved.items())
                  for who, point, moved in events]
    if report.get("trim_host_us_median") is not None:
        lines.append("\ntrim op host time per trimming step of the timed runs (the op without the region "
                     f"it runs): median {report['trim_host_us_median']:.0f} us (wall time: it holds any "
                     "wait for the device inside the op's CUDA calls)")
        for r in report["results"]:
            if r.get("trim_host_us"):
                by_step = r.get("trim_host_us_by_step") or {}
                lines.append(f"- {r['setting']}/{r['mode']}: " + ", ".join(
                    f"{k}: {v:.0f} us" + (f" ({' / '.join(f'{x:.0f}' for x in by_step[k])} by step)"
                                          if k in by_step else "")
                    for k, v in r["trim_host_us"].items()))
    return "\n".join(lines)
