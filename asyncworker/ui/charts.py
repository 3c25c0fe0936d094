"""The console's charts: the per-minute rollup (``Store.minutes``) drawn as
SVG on the server, inline in the page.

No script and no style attribute: the page's policy stays ``default-src
'none'; style-src 'self'``; the bars and lines are coloured by SVG
presentation attributes. Each chart has a <title> and, beside it, a table of
the same figures (the periods that had any), for a reader that cannot see it.

Two spans: the last hour (60 bars of a minute) and the last day (96 bars of
15 minutes). Per bar: done, retried and dead stacked; and a second chart of
the send latency's p50, p90 and p99 (``lease.rules.percentiles``: each the
upper bound of its histogram bucket), on the buckets' own scale.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from html import escape
from typing import Any

from markupsafe import Markup

from lease.rules import LATENCY_BOUNDS_MS, MINUTE_MS, percentiles

__all__ = ["SPANS", "Period", "chart", "periods"]

# (name, title, bars, minutes a bar)
SPANS = (("hour", "the last hour", 60, 1), ("day", "the last day", 96, 15))
OUTCOMES = (("done", "#2f7d32"), ("retried", "#c77c02"), ("dead", "#b3261e"))
QUANTILES = (("p50", 0.5, "#1f5fae"), ("p90", 0.9, "#7b3fb0"), ("p99", 0.99, "#444444"))
WIDTH, HEIGHT, LEFT, BOTTOM = 600, 120, 44, 16


@dataclass
class Period:
    """One bar: from ``start_ms``, the finishes summed over its minutes."""

    start_ms: int
    done: int = 0
    retried: int = 0
    dead: int = 0
    buckets: list[int] = field(default_factory=lambda: [0] * (len(LATENCY_BOUNDS_MS) + 1))

    @property
    def total(self) -> int:
        return self.done + self.retried + self.dead

    def latency(self) -> list[int | None]:
        return percentiles(self.buckets, tuple(q for _, q, _ in QUANTILES))


def periods(rows: Iterable[Mapping[str, Any]], now_ms: int, bars: int,
            minutes_each: int) -> list[Period]:
    """``bars`` periods of ``minutes_each`` minutes ending with the current
    minute's, each the sum of the rows (every endpoint's) in it."""
    step = minutes_each * MINUTE_MS
    end = now_ms - now_ms % MINUTE_MS + MINUTE_MS  # the current minute's end
    first = end - bars * step
    out = [Period(first + index * step) for index in range(bars)]
    for row in rows:
        index = (row["minute_ms"] - first) // step
        if not 0 <= index < bars:
            continue
        period = out[index]
        period.done += row["done"]
        period.retried += row["retried"]
        period.dead += row["dead"]
        period.buckets = [a + b for a, b in zip(period.buckets, row["buckets"], strict=True)]
    return out


def chart(span: str, title: str, bars: list[Period], label: str) -> Markup:
    """The span's two charts and their table, as markup for the page."""
    ident = f"{label}-{span}".replace(" ", "-")
    return Markup("\n".join([
        _outcomes_svg(ident, f"Deliveries per period, {title} ({label})", bars),
        _latency_svg(ident, f"Send latency p50, p90, p99, {title} ({label})", bars),
        _table(ident, title, bars)]))


def _outcomes_svg(ident: str, title: str, bars: list[Period]) -> str:
    top = max((bar.total for bar in bars), default=0) or 1
    width = (WIDTH - LEFT) / len(bars)
    shapes = []
    for index, bar in enumerate(bars):
        base = HEIGHT - BOTTOM
        for name, colour in OUTCOMES:
            count = getattr(bar, name)
            if not count:
                continue
            tall = count / top * (HEIGHT - BOTTOM - 4)
            base -= tall
            shapes.append(
                f'<rect class="bar {name}" data-start="{bar.start_ms}" data-count="{count}"'
                f' x="{LEFT + index * width:.1f}" y="{base:.1f}" width="{max(width - 1, 1):.1f}"'
                f' height="{tall:.1f}" fill="{colour}"><title>{name} {count}</title></rect>')
    return _svg(ident + "-outcomes", title, [
        *_axis(f"{top}", "0"), *shapes,
        *(f'<text x="{LEFT + 70 * i}" y="{HEIGHT - 2}" font-size="10" fill="{colour}">'
          f'{name}</text>' for i, (name, colour) in enumerate(OUTCOMES))])


def _latency_svg(ident: str, title: str, bars: list[Period]) -> str:
    steps = len(LATENCY_BOUNDS_MS)
    width = (WIDTH - LEFT) / len(bars)
    lines = []
    for position, (name, _, colour) in enumerate(QUANTILES):
        points = []
        for index, bar in enumerate(bars):
            value = bar.latency()[position]
            if bar.total and sum(bar.buckets):
                level = steps if value is None else LATENCY_BOUNDS_MS.index(value) + 1
                y = HEIGHT - BOTTOM - level / steps * (HEIGHT - BOTTOM - 4)
                points.append(f"{LEFT + (index + 0.5) * width:.1f},{y:.1f}")
        if points:  # a dot for each point: a line of one point draws nothing
            lines.append(f'<polyline class="line {name}" points="{" ".join(points)}"'
                         f' fill="none" stroke="{colour}" stroke-width="1.5"/>')
            lines.extend(f'<circle class="point {name}" cx="{point.split(",")[0]}"'
                         f' cy="{point.split(",")[1]}" r="2.5" fill="{colour}"/>'
                         for point in points)
    return _svg(ident + "-latency", title, [
        *_axis(f"{LATENCY_BOUNDS_MS[-1] // 1000} s", f"{LATENCY_BOUNDS_MS[0]} ms"), *lines,
        *(f'<text x="{LEFT + 50 * i}" y="{HEIGHT - 2}" font-size="10" fill="{colour}">'
          f'{name}</text>' for i, (name, _, colour) in enumerate(QUANTILES))])


def _axis(top: str, bottom: str) -> list[str]:
    return [f'<line x1="{LEFT}" y1="4" x2="{LEFT}" y2="{HEIGHT - BOTTOM}" stroke="#999"/>',
            f'<line x1="{LEFT}" y1="{HEIGHT - BOTTOM}" x2="{WIDTH}" y2="{HEIGHT - BOTTOM}"'
            f' stroke="#999"/>',
            f'<text x="{LEFT - 4}" y="12" font-size="10" text-anchor="end">{escape(top)}</text>',
            f'<text x="{LEFT - 4}" y="{HEIGHT - BOTTOM}" font-size="10" text-anchor="end">'
            f'{escape(bottom)}</text>']


def _svg(ident: str, title: str, parts: list[str]) -> str:
    return (f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" id="{escape(ident)}"'
            f' role="img" aria-labelledby="{escape(ident)}-title" viewBox="0 0 {WIDTH} {HEIGHT}"'
            f' width="{WIDTH}" height="{HEIGHT}"><title id="{escape(ident)}-title">'
            f'{escape(title)}</title>{"".join(parts)}</svg>')


def _table(ident: str, title: str, bars: list[Period]) -> str:
    """The figures drawn, as a table: the periods that had any."""
    from asyncworker.operations import when

    rows = []
    for bar in bars:
        if not bar.total:
            continue
        p50, p90, p99 = (_ms(value) for value in bar.latency())
        rows.append(f"<tr><td>{escape(when(bar.start_ms))}</td><td class=\"n\">{bar.done}</td>"
                    f"<td class=\"n\">{bar.retried}</td><td class=\"n\">{bar.dead}</td>"
                    f"<td class=\"n\">{p50}</td><td class=\"n\">{p90}</td>"
                    f"<td class=\"n\">{p99}</td></tr>")
    body = "".join(rows) or '<tr><td colspan="7">no finishes</td></tr>'
    return (f'<details><summary>the figures of {escape(title)}</summary>'
            f'<table class="records" id="{escape(ident)}-table"><thead><tr><th>from</th>'
            f"<th>done</th><th>retried</th><th>dead</th><th>p50</th><th>p90</th><th>p99</th>"
            f"</tr></thead><tbody>{body}</tbody></table></details>")


def _ms(value: int | None) -> str:
    return f"> {LATENCY_BOUNDS_MS[-1]} ms" if value is None else f"<= {value} ms"
