"""How mtdao writes byte counts and traffic ratios: one convention for the progress bar, the
training summary, the communicator's account and every experiment report.

Depends on nothing in mtdao, so the sync package, the training harness and the experiments can
all import it.
"""

from __future__ import annotations

import math


def format_bytes(num_bytes: float) -> str:
    """1536 -> '1.5 kB', 2.5e9 -> '2.5 GB': decimal units, as links are rated. Every byte count
    mtdao prints (progress bar, summaries, reports) goes through here."""
    for unit, size in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if num_bytes >= size:
            return f"{num_bytes / size:.1f} {unit}"
    return f"{num_bytes:.0f} B"


def format_traffic(ratio: float, versus: str = "") -> str:
    """A traffic ratio (reference bytes / these bytes): 'the same', '3.3x less', '1.2x more' or
    'nothing sent'; ``versus`` names the reference ('DDP' -> '3.3x less than DDP'). A ratio near
    but not at 1 gets a second decimal, so that nothing reads '1.0x less'."""
    if math.isinf(ratio):
        return "nothing sent"
    if abs(ratio - 1) < 1e-9:
        return f"the same as {versus}" if versus else "the same"
    factor = ratio if ratio > 1 else 1 / ratio
    digits = 1 if f"{factor:.1f}" != "1.0" else 2
    text = f"{factor:.{digits}f}x {'less' if ratio > 1 else 'more'}"
    return f"{text} than {versus}" if versus else text
