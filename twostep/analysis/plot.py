"""The roofline chart: attainable FLOP/s against arithmetic intensity, log-log, with the prefill
points (one per prompt length) and the decode points (one per batch size)."""
from __future__ import annotations

from pathlib import Path

from twostep.analysis.analyze import Analysis
from twostep.analysis.roofline import PhasePoint

FORMATS = (".png", ".svg", ".pdf")
# SVG group ids of the two point series, so tools (and tests) can find the points in the file.
PREFILL_GID = "prefill-points"
DECODE_GID = "decode-points"


def plot_roofline(a: Analysis, path: str | Path) -> tuple[PhasePoint, ...]:
    """Write the chart (format from the extension) and return the points drawn, prefill first."""
    path = Path(path)
    if path.suffix.lower() not in FORMATS:
        raise ValueError(f"--plot {str(path)!r}: the file name must end in {', '.join(FORMATS)}")
    # Figure without pyplot: no global figure registry and no GUI backend, so it works headless
    # and leaves nothing behind.
    try:
        from matplotlib.figure import Figure
    except ImportError:
        raise ValueError("the roofline chart needs matplotlib: pip install 'twostep[plot]'") from None

    fig = Figure(figsize=(9, 6), layout="constrained")
    ax = fig.add_subplot()
    ax.set_xscale("log")
    ax.set_yscale("log")
    scale, unit = _flops_unit(a.hardware.peak_flops)
    _draw_roof(ax, a, scale, unit)
    _draw_points(ax, a.prefill, scale, "o", "tab:blue", PREFILL_GID,
                 "prefill, 1 sequence of S tokens", lambda p: f"S={p.tokens:,}", above=True)
    _draw_points(ax, a.decode, scale, "s", "tab:orange", DECODE_GID,
                 f"decode, B sequences at context {a.crossover.decode_context:,}",
                 lambda p: f"B={p.batch:,}", above=False)
    ax.set_ylim(top=a.hardware.peak_flops / scale * 2.5)     # room for labels over the flat roof
    ax.set_xlabel("arithmetic intensity (FLOP/byte)")
    ax.set_ylabel(f"attainable performance ({unit})")
    ax.set_title(f"{a.model.name}, {a.model.weight_format} weights, {a.model.kv.format} KV, "
                 f"on {a.hardware.name}")
    ax.grid(True, which="major", alpha=0.3)
    # Below the chart: inside it, any corner can hide points once the ridge moves.
    fig.legend(loc="outside lower center", ncols=2, fontsize=9)
    fig.savefig(path)
    return a.prefill + a.decode


def _flops_unit(peak: float) -> tuple[float, str]:
    return (1e12, "TFLOP/s") if peak >= 1e12 else (1e9, "GFLOP/s")


def _draw_roof(ax, a: Analysis, scale: float, unit: str) -> None:
    hw = a.hardware
    xs = [p.intensity for p in a.prefill + a.decode] + [hw.ridge]
    lo, hi = min(xs) / 3, max(xs) * 3
    ax.plot([lo, hw.ridge, hi], [lo * hw.bandwidth / scale, hw.peak_flops / scale,
                                  hw.peak_flops / scale],
            color="black", linewidth=2, label=f"roof: {hw.bandwidth / 1e9:,.0f} GB/s x intensity, "
                                              f"capped at {hw.peak_flops / scale:,.4g} {unit}")
    ax.axvline(hw.ridge, color="gray", linestyle="--", linewidth=1)
    # Under the roof's slope the chart is empty: the ridge's labels go there, clear of the points.
    at_bottom = ax.get_xaxis_transform()
    ax.text(hw.ridge, 0.04, f"ridge {hw.ridge:,.1f} FLOP/byte  ", transform=at_bottom, ha="right",
            fontsize=9, color="dimgray")
    ax.text(hw.ridge, 0.04, "  memory-bound | compute-bound", transform=at_bottom, ha="left",
            fontsize=9, color="dimgray")


def _draw_points(ax, points: tuple[PhasePoint, ...], scale: float, marker: str, color: str,
                 gid: str, label: str, name, above: bool) -> None:
    xs = [p.intensity for p in points]
    ys = [p.attainable_flops / scale for p in points]
    ax.plot(xs, ys, linestyle="none", marker=marker, markersize=8, color=color, label=label, gid=gid)
    # Points lie on the roof: labels go off it, prefill's up and left, decode's down and right,
    # so the two series do not write over each other where they meet; every other label steps
    # further out for neighbours crowded on the flat part.
    for i, (p, x, y) in enumerate(zip(points, xs, ys)):
        dy = 6 + 10 * (i % 2)
        ax.annotate(name(p), (x, y), xytext=(-6, dy) if above else (6, -dy - 6),
                    textcoords="offset points", ha="right" if above else "left", fontsize=8,
                    color=color)
