"""Shared checks for the client scripts: every picture decodes and carries its recipe."""

import base64
import io
import sys

from PIL import Image


def fail(msg):
    print(f"FAIL: {msg}", file=sys.stderr)
    sys.exit(1)


def check_png(data, what, size=None):
    """Decodes a PNG (bytes or base64 text) and checks its recipe text chunk."""
    if isinstance(data, str):
        if data.startswith("data:"):
            data = data.split(",", 1)[1]
        data = base64.b64decode(data)
    img = Image.open(io.BytesIO(data))
    img.load()
    if img.format != "PNG":
        fail(f"{what}: {img.format}, not PNG")
    if size is not None and img.size != size:
        fail(f"{what}: size {img.size}, expected {size}")
    text = getattr(img, "text", {}) or {}
    recipe = text.get("parameters") or text.get("brume-recipe")
    if not recipe:
        fail(f"{what}: no recipe text chunk (has {sorted(text)})")
    return img, text


def test_png(size=128, alpha_hole=False):
    """A gradient picture; with alpha_hole, an RGBA mask whose centre is transparent."""
    if alpha_hole:
        img = Image.new("RGBA", (size, size), (0, 0, 0, 255))
        q = size // 4
        for x in range(q, size - q):
            for y in range(q, size - q):
                img.putpixel((x, y), (0, 0, 0, 0))
    else:
        img = Image.new("RGB", (size, size))
        for x in range(size):
            for y in range(size):
                img.putpixel((x, y), (x * 255 // size, y * 255 // size, 90))
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()
