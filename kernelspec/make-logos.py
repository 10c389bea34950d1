"""Draws kernelspec/logo-32x32.png and logo-64x64.png (stacked memory bars) with the standard
library only. Run from the repository root: python3 kernelspec/make-logos.py"""
import struct
import zlib

COLORS = [(238, 76, 44), (255, 165, 0), (66, 133, 244), (52, 168, 83)]  # torch orange, amber, blue, green
BACKGROUND = (40, 44, 52)


def pixel(x, y, size):
    u, v = x / size, y / size
    margin = 0.12
    if not (margin <= u < 1 - margin and margin <= v < 1 - margin):
        return BACKGROUND
    # four bars of rising height, each split into stacked categories
    bar = int((u - margin) / ((1 - 2 * margin) / 4))
    inner = ((u - margin) / ((1 - 2 * margin) / 4)) % 1
    if inner > 0.8:
        return BACKGROUND
    top = 1 - margin - (0.25 + 0.17 * bar)
    if v < top:
        return BACKGROUND
    band = int((v - top) / ((1 - margin - top) / 4 + 1e-9))
    return COLORS[min(band, 3)]


def png(size):
    rows = b"".join(
        b"\x00" + b"".join(bytes(pixel(x, y, size)) for x in range(size)) for y in range(size)
    )

    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", size, size, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows, 9)) + chunk(b"IEND", b"")


for size in (32, 64):
    with open(f"kernelspec/logo-{size}x{size}.png", "wb") as f:
        f.write(png(size))
