"""Pictures the tools write: dependency-free raster images, and matplotlib figures.

Raster images (the schedule simulator's timeline, tools/simulate_schedule.py): an RGB image as a
numpy array, rectangles, a 5x7 pixel font and a PNG writer (zlib + struct only).  Images are
``uint8 [height, width, 3]`` arrays; ``(x, y)`` is (column, row) with the origin at the top left.
Rectangles are half-open (``[x0, x1) x [y0, y1)``) and clipped to the image.

Figures (the plan of tools/plan_report.py): matplotlib, the optional extra "plot".
:func:`new_figure` raises :class:`PlottingUnavailable` naming the extra to install when matplotlib
is missing; it never touches pyplot's global state (no display, no backend switch), and
:func:`save_figure` writes the PNG atomically like :func:`write_png`.
"""
from __future__ import annotations

import os
import struct
import zlib
from typing import Sequence

import numpy as np

__all__ = ["blank", "fill_rect", "draw_text", "text_width", "write_png", "GLYPH_WIDTH", "GLYPH_HEIGHT",
           "PLOT_INSTALL", "PlottingUnavailable", "require_matplotlib", "new_figure", "save_figure"]

#: how to install the optional extra that figures need
PLOT_INSTALL = 'pip install -e ".[plot]"'

GLYPH_WIDTH, GLYPH_HEIGHT = 5, 7

# 5x7 glyphs, one string per pixel row ('#' = ink).  Lower-case text is drawn in upper case;
# a character without a glyph is drawn as '?'.
_GLYPHS = {
    "A": (".###.", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "B": ("####.", "#...#", "#...#", "####.", "#...#", "#...#", "####."),
    "C": (".###.", "#...#", "#....", "#....", "#....", "#...#", ".###."),
    "D": ("####.", "#...#", "#...#", "#...#", "#...#", "#...#", "####."),
    "E": ("#####", "#....", "#....", "####.", "#....", "#....", "#####"),
    "F": ("#####", "#....", "#....", "####.", "#....", "#....", "#...."),
    "G": (".###.", "#...#", "#....", "#.###", "#...#", "#...#", ".###."),
    "H": ("#...#", "#...#", "#...#", "#####", "#...#", "#...#", "#...#"),
    "I": (".###.", "..#..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "J": ("..###", "...#.", "...#.", "...#.", "...#.", "#..#.", ".##.."),
    "K": ("#...#", "#..#.", "#.#..", "##...", "#.#..", "#..#.", "#...#"),
    "L": ("#....", "#....", "#....", "#....", "#....", "#....", "#####"),
    "M": ("#...#", "##.##", "#.#.#", "#.#.#", "#...#", "#...#", "#...#"),
    "N": ("#...#", "#...#", "##..#", "#.#.#", "#..##", "#...#", "#...#"),
    "O": (".###.", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "P": ("####.", "#...#", "#...#", "####.", "#....", "#....", "#...."),
    "Q": (".###.", "#...#", "#...#", "#...#", "#.#.#", "#..#.", ".##.#"),
    "R": ("####.", "#...#", "#...#", "####.", "#.#..", "#..#.", "#...#"),
    "S": (".####", "#....", "#....", ".###.", "....#", "....#", "####."),
    "T": ("#####", "..#..", "..#..", "..#..", "..#..", "..#..", "..#.."),
    "U": ("#...#", "#...#", "#...#", "#...#", "#...#", "#...#", ".###."),
    "V": ("#...#", "#...#", "#...#", "#...#", "#...#", ".#.#.", "..#.."),
    "W": ("#...#", "#...#", "#...#", "#.#.#", "#.#.#", "#.#.#", ".#.#."),
    "X": ("#...#", "#...#", ".#.#.", "..#..", ".#.#.", "#...#", "#...#"),
    "Y": ("#...#", "#...#", ".#.#.", "..#..", "..#..", "..#..", "..#.."),
    "Z": ("#####", "....#", "...#.", "..#..", ".#...", "#....", "#####"),
    "0": (".###.", "#...#", "#..##", "#.#.#", "##..#", "#...#", ".###."),
    "1": ("..#..", ".##..", "..#..", "..#..", "..#..", "..#..", ".###."),
    "2": (".###.", "#...#", "....#", "...#.", "..#..", ".#...", "#####"),
    "3": ("#####", "...#.", "..#..", "...#.", "....#", "#...#", ".###."),
    "4": ("...#.", "..##.", ".#.#.", "#..#.", "#####", "...#.", "...#."),
    "5": ("#####", "#....", "####.", "....#", "....#", "#...#", ".###."),
    "6": ("..##.", ".#...", "#....", "####.", "#...#", "#...#", ".###."),
    "7": ("#####", "....#", "...#.", "..#..", ".#...", ".#...", ".#..."),
    "8": (".###.", "#...#", "#...#", ".###.", "#...#", "#...#", ".###."),
    "9": (".###.", "#...#", "#...#", ".####", "....#", "...#.", ".##.."),
    " ": (".....",) * 7,
    ".": (".....", ".....", ".....", ".....", ".....", ".##..", ".##.."),
    ",": (".....", ".....", ".....", ".....", ".##..", "..#..", ".#..."),
    ":": (".....", ".##..", ".##..", ".....", ".##..", ".##..", "....."),
    "-": (".....", ".....", ".....", "#####", ".....", ".....", "....."),
    "+": (".....", "..#..", "..#..", "#####", "..#..", "..#..", "....."),
    "=": (".....", ".....", "#####", ".....", "#####", ".....", "....."),
    "%": ("##...", "##..#", "...#.", "..#..", ".#...", "#..##", "...##"),
    "/": (".....", "....#", "...#.", "..#..", ".#...", "#....", "....."),
    "(": ("...#.", "..#..", ".#...", ".#...", ".#...", "..#..", "...#."),
    ")": (".#...", "..#..", "...#.", "...#.", "...#.", "..#..", ".#..."),
    "_": (".....", ".....", ".....", ".....", ".....", ".....", "#####"),
    "?": (".###.", "#...#", "....#", "...#.", "..#..", ".....", "..#.."),
}
_MASKS = {c: np.array([[ch == "#" for ch in row] for row in rows], dtype=bool) for c, rows in _GLYPHS.items()}


def _check_image(image) -> None:
    if not isinstance(image, np.ndarray) or image.dtype != np.uint8 or image.ndim != 3 or image.shape[2] != 3:
        raise ValueError("an image must be a uint8 numpy array [height, width, 3]")


def blank(height: int, width: int, color: Sequence[int] = (255, 255, 255)) -> np.ndarray:
    """A new ``height x width`` RGB image filled with ``color``."""
    if int(height) < 1 or int(width) < 1:
        raise ValueError(f"an image needs at least one pixel, got {height} x {width}")
    img = np.empty((int(height), int(width), 3), dtype=np.uint8)
    img[:, :] = color
    return img


def fill_rect(image: np.ndarray, x0: int, y0: int, x1: int, y1: int, color: Sequence[int]) -> None:
    """Paint ``[x0, x1) x [y0, y1)`` with ``color``, clipped to the image (nothing if empty)."""
    h, w = image.shape[:2]
    x0, x1 = max(0, int(x0)), min(w, int(x1))
    y0, y1 = max(0, int(y0)), min(h, int(y1))
    if x0 < x1 and y0 < y1:
        image[y0:y1, x0:x1] = color


def text_width(text: str, scale: int = 1) -> int:
    """Width in pixels of ``text`` drawn by :func:`draw_text` (one blank column between glyphs)."""
    n = len(text)
    return 0 if n == 0 else (n * (GLYPH_WIDTH + 1) - 1) * scale


def draw_text(image: np.ndarray, x: int, y: int, text: str, color: Sequence[int] = (0, 0, 0),
              scale: int = 1) -> int:
    """Draw ``text`` with its top-left corner at ``(x, y)``, each font pixel a ``scale`` square;
    clipped to the image.  Returns the x just after the text."""
    for ch in text.upper():
        mask = _MASKS.get(ch, _MASKS["?"])
        ys, xs = np.nonzero(mask)
        for r, c in zip(ys.tolist(), xs.tolist()):
            fill_rect(image, x + c * scale, y + r * scale, x + (c + 1) * scale, y + (r + 1) * scale, color)
        x += (GLYPH_WIDTH + 1) * scale
    return x


def write_png(path: str, image: np.ndarray) -> None:
    """Write an RGB uint8 image [H, W, 3] as a PNG file (no dependency: zlib + struct).

    The file appears atomically (written to a temporary name, then renamed)."""
    _check_image(image)
    h, w, _ = image.shape
    raw = np.concatenate([np.zeros((h, 1), np.uint8), image.reshape(h, w * 3)], axis=1).tobytes()

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    png = (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
           + chunk(b"IDAT", zlib.compress(raw, 9)) + chunk(b"IEND", b""))
    tmp = f"{path}.tmp{os.getpid()}"
    with open(tmp, "wb") as fh:
        fh.write(png)
    os.replace(tmp, path)


# ---------------------------------------------------------------------------
# matplotlib figures
# ---------------------------------------------------------------------------

class PlottingUnavailable(ImportError):
    """matplotlib, the optional extra "plot", is not installed; the message says how to install it."""


def require_matplotlib() -> None:
    """Return when matplotlib can draw figures; else :class:`PlottingUnavailable` (tools call it
    before their work, so that a missing extra fails at once)."""
    try:
        import matplotlib.figure  # noqa: F401
        import matplotlib.patches  # noqa: F401
    except ImportError:
        raise PlottingUnavailable(f'matplotlib is not installed; it is the optional extra "plot": '
                                  f'{PLOT_INSTALL}') from None


def new_figure(width: float, height: float, dpi: int = 110):
    """A matplotlib ``Figure`` of ``width`` x ``height`` inches with constrained layout (labels and
    legends outside the axes keep their room), detached from pyplot (rendered by Agg when saved).
    :class:`PlottingUnavailable` when matplotlib is not installed."""
    require_matplotlib()
    from matplotlib.figure import Figure
    return Figure(figsize=(float(width), float(height)), dpi=dpi, layout="constrained")


def save_figure(figure, path: str) -> None:
    """Write ``figure`` as a PNG file; the file appears atomically (temporary name, then rename)."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        figure.savefig(tmp, format="png", facecolor="white")
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
