"""Checks that a PNG written by a plot command is a real picture."""

from __future__ import annotations

from pathlib import Path


def assert_picture(path: Path, size: tuple[int, int], max_bytes: int = 200_000) -> None:
    """``path`` is a PNG of ``size`` (width, height) pixels, under
    ``max_bytes``, and not blank: a good share of its pixels are not the
    background and it holds several colours (axes, lines, legends)."""
    from matplotlib import image

    assert path.exists(), f"{path} was not written"
    assert 5_000 < path.stat().st_size < max_bytes, path.stat().st_size
    pixels = image.imread(str(path))
    height, width = pixels.shape[:2]
    assert (width, height) == size
    rgb = pixels[..., :3]
    drawn = (rgb < 0.95).any(axis=-1).mean()
    assert drawn > 0.02, f"only {drawn:.1%} of the picture is drawn"
    colours = {tuple(c) for c in (rgb[::4, ::4].reshape(-1, 3) * 16).astype(int).tolist()}
    assert len(colours) > 8, f"{len(colours)} colours: blank or one-colour picture"
