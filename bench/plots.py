"""Small, dependency-free SVG charts for the self-contained HTML report (line and stacked bars)."""

from __future__ import annotations

import html
import math

PALETTE = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf"]
W, H = 460, 300
L, R, T, B = 64, 150, 34, 44  # margins: legend on the right


def _ticks(lo: float, hi: float, n: int = 5) -> list[float]:
    if hi <= lo:
        hi = lo + 1.0
    step = 10 ** math.floor(math.log10((hi - lo) / n))
    for m in (1, 2, 5, 10):
        if (hi - lo) / (step * m) <= n:
            step *= m
            break
    first = math.floor(lo / step) * step
    return [first + i * step for i in range(int((hi - first) / step) + 2) if first + i * step <= hi + step * 1e-9]


def _label(v: float) -> str:
    return f"{v:.4g}"


def _frame(title: str, xlabel: str, ylabel: str, plot_id: str, body: str) -> str:
    return (
        f"<svg id='{html.escape(plot_id)}' class='plot' xmlns='http://www.w3.org/2000/svg' width='{W}' height='{H}' "
        f"viewBox='0 0 {W} {H}' role='img' aria-label='{html.escape(title)}'>"
        f"<rect width='{W}' height='{H}' fill='white' stroke='#ddd'/>"
        f"<text x='{W / 2}' y='20' text-anchor='middle' font-size='14' font-weight='bold'>{html.escape(title)}</text>"
        f"<text x='{(L + W - R) / 2}' y='{H - 8}' text-anchor='middle' font-size='12'>{html.escape(xlabel)}</text>"
        f"<text x='14' y='{(T + H - B) / 2}' text-anchor='middle' font-size='12' "
        f"transform='rotate(-90 14 {(T + H - B) / 2})'>{html.escape(ylabel)}</text>{body}</svg>"
    )


def line_svg(
    title: str,
    xlabel: str,
    ylabel: str,
    series: dict[str, list[tuple[float, float]]],
    plot_id: str,
    from_zero: bool = True,
) -> str:
    points = [p for s in series.values() for p in s]
    if not points:
        return _frame(
            title, xlabel, ylabel, plot_id, f"<text x='{W / 2}' y='{H / 2}' text-anchor='middle'>no data</text>"
        )
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    x0, x1 = min(xs), max(xs) if max(xs) > min(xs) else min(xs) + 1
    if from_zero:
        y0, y1 = min(0.0, min(ys)), max(ys) * 1.08 if max(ys) > 0 else 1.0
    else:  # zoom on the data (loss curves): a small margin around the range
        pad = (max(ys) - min(ys)) * 0.08 or abs(max(ys)) * 0.01 or 1.0
        y0, y1 = min(ys) - pad, max(ys) + pad
        y0 = _ticks(y0, y1)[0]
    yt = _ticks(y0, y1)
    y1 = max(y1, yt[-1])
    sx = lambda x: L + (x - x0) / (x1 - x0) * (W - L - R)  # noqa: E731
    sy = lambda y: H - B - (y - y0) / (y1 - y0) * (H - T - B)  # noqa: E731
    body = [
        f"<line x1='{L}' y1='{H - B}' x2='{W - R}' y2='{H - B}' stroke='#444'/>",
        f"<line x1='{L}' y1='{T}' x2='{L}' y2='{H - B}' stroke='#444'/>",
    ]
    for t in yt:
        body.append(
            f"<line x1='{L}' y1='{sy(t):.1f}' x2='{W - R}' y2='{sy(t):.1f}' stroke='#eee'/>"
            f"<text x='{L - 4}' y='{sy(t) + 4:.1f}' text-anchor='end' font-size='10'>{_label(t)}</text>"
        )
    for t in sorted(set(xs)) if len(set(xs)) <= 12 else _ticks(x0, x1):
        body.append(f"<text x='{sx(t):.1f}' y='{H - B + 14}' text-anchor='middle' font-size='10'>{_label(t)}</text>")
    for i, (name, pts) in enumerate(series.items()):
        color = PALETTE[i % len(PALETTE)]
        pts = sorted(pts)
        path = " ".join(f"{sx(x):.1f},{sy(y):.1f}" for x, y in pts)
        body.append(
            f"<polyline fill='none' stroke='{color}' stroke-width='2' points='{path}' data-series='{html.escape(name)}'/>"
        )
        if len(pts) <= 20:
            body += [
                f"<circle cx='{sx(x):.1f}' cy='{sy(y):.1f}' r='3' fill='{color}'><title>{html.escape(name)}: "
                f"{_label(x)}, {_label(y)}</title></circle>"
                for x, y in pts
            ]
        body.append(
            f"<rect x='{W - R + 8}' y='{T + 14 * i}' width='10' height='10' fill='{color}'/>"
            f"<text x='{W - R + 22}' y='{T + 9 + 14 * i}' font-size='10'>{html.escape(name[:24])}</text>"
        )
    return _frame(title, xlabel, ylabel, plot_id, "".join(body))


def bar_stack_svg(title: str, ylabel: str, bars: dict[str, dict[str, float]], plot_id: str) -> str:
    if not bars:
        return _frame(title, "", ylabel, plot_id, f"<text x='{W / 2}' y='{H / 2}' text-anchor='middle'>no data</text>")
    parts = sorted({k for b in bars.values() for k in b})
    top = max(sum(b.values()) for b in bars.values()) * 1.08 or 1.0
    yt = _ticks(0, top)
    top = max(top, yt[-1])
    sy = lambda y: H - B - y / top * (H - T - B)  # noqa: E731
    width = (W - L - R) / len(bars)
    body = [f"<line x1='{L}' y1='{H - B}' x2='{W - R}' y2='{H - B}' stroke='#444'/>"]
    for t in yt:
        body.append(
            f"<line x1='{L}' y1='{sy(t):.1f}' x2='{W - R}' y2='{sy(t):.1f}' stroke='#eee'/>"
            f"<text x='{L - 4}' y='{sy(t) + 4:.1f}' text-anchor='end' font-size='10'>{_label(t)}</text>"
        )
    for i, (name, stack) in enumerate(bars.items()):
        x, base = L + i * width + width * 0.15, 0.0
        for j, part in enumerate(parts):
            v = stack.get(part, 0.0)
            body.append(
                f"<rect x='{x:.1f}' y='{sy(base + v):.1f}' width='{width * 0.7:.1f}' height='{sy(base) - sy(base + v):.1f}' "
                f"fill='{PALETTE[j % len(PALETTE)]}'><title>{html.escape(name)} {part}: {v:.2f}</title></rect>"
            )
            base += v
        body.append(
            f"<text x='{x + width * 0.35:.1f}' y='{H - B + 12}' text-anchor='end' font-size='8' "
            f"transform='rotate(-30 {x + width * 0.35:.1f} {H - B + 12})'>{html.escape(name[:22])}</text>"
        )
    for j, part in enumerate(parts):
        body.append(
            f"<rect x='{W - R + 8}' y='{T + 14 * j}' width='10' height='10' fill='{PALETTE[j % len(PALETTE)]}'/>"
            f"<text x='{W - R + 22}' y='{T + 9 + 14 * j}' font-size='10'>{html.escape(part)}</text>"
        )
    return _frame(title, "", ylabel, plot_id, "".join(body))
