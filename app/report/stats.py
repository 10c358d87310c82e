"""95% intervals of proportions for the report: Wilson's for one rate, Newcombe's for the difference of two."""

from __future__ import annotations

from monitors.alerts import Z95


def _wilson(p: float, n: float) -> tuple[float, float]:
    """95% Wilson interval of a proportion p over n samples."""
    if n <= 0:
        return p, p
    z2 = Z95 * Z95
    centre = (p + z2 / (2 * n)) / (1 + z2 / n)
    half = Z95 * (p * (1 - p) / n + z2 / (4 * n * n)) ** 0.5 / (1 + z2 / n)
    return centre - half, centre + half


def newcombe(p1: float, n1: float, p2: float, n2: float) -> tuple[float, float]:
    """95% interval of ``p2 - p1`` (Newcombe's hybrid score method from each rate's Wilson interval)."""
    l1, u1 = _wilson(p1, n1)
    l2, u2 = _wilson(p2, n2)
    d = p2 - p1
    return d - ((p2 - l2) ** 2 + (u1 - p1) ** 2) ** 0.5, d + ((u2 - p2) ** 2 + (p1 - l1) ** 2) ** 0.5
