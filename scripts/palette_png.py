"""Save a matplotlib figure as a 256-colour palette PNG: the line plots and bar charts in docs/ look the
same and take about 40 % of the bytes. The repository travels to the device machine beside a 58 MiB
package bundle, within 64 MiB, so the plots it keeps must stay small."""

from __future__ import annotations

import io
from pathlib import Path


def save(fig, path: str | Path, dpi: int) -> None:
    """fig rendered at `dpi`, quantized to 256 colours (no dithering: flat fills stay flat), written to path."""
    from PIL import Image

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    buf.seek(0)
    with Image.open(buf) as im:
        im.convert("RGB").quantize(colors=256, method=Image.Quantize.MEDIANCUT, dither=Image.Dither.NONE).save(
            path, format="PNG", optimize=True)
