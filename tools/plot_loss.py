#!/usr/bin/env python3
"""Draw the loss curve of a `tools/train_small.py` run (its `train_log.json`) as a PNG.

The training box may lack matplotlib and this machine may too, so there are two renderers: matplotlib when it
imports, else a small built-in one that rasterises the curve itself and writes the PNG with zlib. The built-in
chart has axes, integer loss grid lines, numeric tick labels (a 3x5 pixel digit font), the training loss as a
blue line and the held-out loss as red dots; it has no other text, which is what the caption in
docs/quality.md is for.

    python tools/plot_loss.py strata/models/default/train_log.json loss.png
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import struct
import sys
import zlib
from pathlib import Path

Point = tuple[float, float]

WIDTH, HEIGHT = 800, 480
MARGIN_L, MARGIN_R, MARGIN_T, MARGIN_B = 56, 20, 20, 40
WHITE, BLACK, GREY = (255, 255, 255), (0, 0, 0), (225, 225, 225)
BLUE, RED = (31, 119, 180), (214, 39, 40)

# 3x5 bitmaps, one string of 15 bits per glyph, rows top to bottom.
_GLYPHS = {
    "0": "111101101101111", "1": "010110010010111", "2": "111001111100111", "3": "111001111001111",
    "4": "101101111001001", "5": "111100111001111", "6": "111100111101111", "7": "111001001001001",
    "8": "111101111101111", "9": "111101111001111", ".": "000000000000010",
}


def series(log: dict) -> tuple[list[Point], list[Point]]:
    """(training loss points, held-out loss points) as (step, loss) pairs."""
    train = [(float(r["step"]), float(r["loss"])) for r in log.get("train", [])]
    heldout = [(float(r["step"]), float(r["loss"])) for r in log.get("eval", [])]
    return train, heldout


def plot(log: dict, png: Path) -> str:
    """Write the chart to `png`; returns which renderer drew it ("matplotlib" or "builtin")."""
    train, heldout = series(log)
    if not train and not heldout:
        raise ValueError("the log holds no loss points")
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        png.write_bytes(_builtin_png(train, heldout))
        return "builtin"
    fig, ax = plt.subplots(figsize=(8, 4.8), dpi=100)
    if train:
        ax.plot([p[0] for p in train], [p[1] for p in train], color="tab:blue", lw=1.2, label="training loss")
    if heldout:
        ax.plot([p[0] for p in heldout], [p[1] for p in heldout], "o", color="tab:red", ms=4,
                label="held-out loss")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats / token)")
    title = log.get("title")
    if title:
        ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)
    return "matplotlib"


class _Canvas:
    """An RGB raster with just the drawing operations the chart needs."""

    def __init__(self, w: int, h: int):
        self.w, self.h = w, h
        self.px = bytearray(bytes(WHITE) * (w * h))

    def dot(self, x: int, y: int, c: tuple[int, int, int]) -> None:
        if 0 <= x < self.w and 0 <= y < self.h:
            i = 3 * (y * self.w + x)
            self.px[i:i + 3] = bytes(c)

    def line(self, x0: int, y0: int, x1: int, y1: int, c: tuple[int, int, int]) -> None:
        dx, dy = abs(x1 - x0), -abs(y1 - y0)
        sx, sy = (1 if x0 < x1 else -1), (1 if y0 < y1 else -1)
        err = dx + dy
        while True:
            self.dot(x0, y0, c)
            if x0 == x1 and y0 == y1:
                return
            e2 = 2 * err
            if e2 >= dy:
                err += dy
                x0 += sx
            if e2 <= dx:
                err += dx
                y0 += sy

    def text(self, x: int, y: int, s: str, c: tuple[int, int, int], scale: int = 2) -> None:
        for k, ch in enumerate(s):
            bits = _GLYPHS.get(ch)
            if bits is None:
                continue
            for r in range(5):
                for q in range(3):
                    if bits[3 * r + q] == "1":
                        for a in range(scale):
                            for b in range(scale):
                                self.dot(x + k * 4 * scale + q * scale + a, y + r * scale + b, c)

    def png(self) -> bytes:
        raw = b"".join(b"\x00" + bytes(self.px[3 * self.w * y:3 * self.w * (y + 1)]) for y in range(self.h))

        def chunk(kind: bytes, data: bytes) -> bytes:
            return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

        ihdr = struct.pack(">IIBBBBB", self.w, self.h, 8, 2, 0, 0, 0)
        return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", zlib.compress(raw, 9)) + \
            chunk(b"IEND", b"")


def _nice_step(span: float, target: int) -> float:
    raw = span / max(target, 1)
    mag = 10 ** math.floor(math.log10(raw)) if raw > 0 else 1.0
    for m in (1, 2, 5, 10):
        if m * mag >= raw:
            return m * mag
    return 10 * mag


def _builtin_png(train: list[Point], heldout: list[Point]) -> bytes:
    pts = train + heldout
    x_max = max(p[0] for p in pts) or 1.0
    y_lo = math.floor(min(p[1] for p in pts))
    y_hi = math.ceil(max(p[1] for p in pts))
    if y_hi <= y_lo:
        y_hi = y_lo + 1
    cv = _Canvas(WIDTH, HEIGHT)
    x0, x1 = MARGIN_L, WIDTH - MARGIN_R
    y0, y1 = HEIGHT - MARGIN_B, MARGIN_T

    def px(p: Point) -> tuple[int, int]:
        return (round(x0 + (x1 - x0) * p[0] / x_max), round(y0 + (y1 - y0) * (p[1] - y_lo) / (y_hi - y_lo)))

    y_step = _nice_step(y_hi - y_lo, 8)
    v = y_lo
    while v <= y_hi + 1e-9:
        _, y = px((0.0, v))
        cv.line(x0, y, x1, y, GREY)
        label = f"{v:g}"
        cv.text(x0 - 8 - len(label) * 8, y - 5, label, BLACK)
        v += y_step
    x_step = _nice_step(x_max, 6)
    v = 0.0
    while v <= x_max + 1e-9:
        x, _ = px((v, y_lo))
        cv.line(x, y0, x, y0 + 5, BLACK)
        label = f"{v:g}"
        cv.text(x - len(label) * 4, y0 + 10, label, BLACK)
        v += x_step
    cv.line(x0, y0, x1, y0, BLACK)
    cv.line(x0, y0, x0, y1, BLACK)
    for a, b in itertools.pairwise(train):
        cv.line(*px(a), *px(b), BLUE)
    for p in heldout:
        x, y = px(p)
        for dx in range(-2, 3):
            for dy in range(-2, 3):
                cv.dot(x + dx, y + dy, RED)
    return cv.png()


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Plot train_log.json from tools/train_small.py as a PNG.")
    ap.add_argument("log", type=Path, help="train_log.json")
    ap.add_argument("png", type=Path, help="output PNG path")
    args = ap.parse_args(argv)
    try:
        log = json.loads(args.log.read_text())
        how = plot(log, args.png)
    except (OSError, ValueError) as e:
        print(f"plot_loss: error: {e}", file=sys.stderr)
        return 2
    print(f"wrote {args.png} ({how})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
