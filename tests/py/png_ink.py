"""The share of a PNG's pixels that are not white, and how many are of one colour, for the
report's screenshot test: a page that drew nothing gives 0, and a page whose charts were not
drawn has none of their line colour. Standard library only (zlib): 8-bit RGB or RGBA, no
interlace.

    python3 png_ink.py SHOT.png [RRGGBB]      # prints: <share not white> <pixels of RRGGBB>
"""

import struct
import sys
import zlib


def pixels(path: str):
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError(f"{path} is not a PNG")
    pos, idat, header = 8, b"", None
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            header = struct.unpack(">IIBBBBB", body)
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    width, height, depth, colour, _, _, interlace = header
    if depth != 8 or colour not in (2, 6) or interlace:
        raise ValueError(f"unsupported PNG: depth {depth}, colour type {colour}, interlace {interlace}")
    bpp = 3 if colour == 2 else 4
    raw = zlib.decompress(idat)
    stride = width * bpp
    previous = bytearray(stride)
    rows = []
    for y in range(height):
        kind = raw[y * (stride + 1)]
        line = bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        for i in range(stride):
            left = line[i - bpp] if i >= bpp else 0
            up = previous[i]
            corner = previous[i - bpp] if i >= bpp else 0
            if kind == 1:
                line[i] = (line[i] + left) & 0xFF
            elif kind == 2:
                line[i] = (line[i] + up) & 0xFF
            elif kind == 3:
                line[i] = (line[i] + (left + up) // 2) & 0xFF
            elif kind == 4:
                p = left + up - corner
                pa, pb, pc = abs(p - left), abs(p - up), abs(p - corner)
                pred = left if pa <= pb and pa <= pc else up if pb <= pc else corner
                line[i] = (line[i] + pred) & 0xFF
        rows.append(line)
        previous = line
    return width, height, bpp, rows


def main(path: str, colour: str) -> None:
    width, height, bpp, rows = pixels(path)
    wanted = bytes.fromhex(colour) if colour else None
    ink = hits = 0
    for line in rows:
        for x in range(width):
            px = bytes(line[x * bpp : x * bpp + 3])
            if px != b"\xff\xff\xff":
                ink += 1
                if px == wanted:
                    hits += 1
    print(f"{ink / (width * height):.4f} {hits}")


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2] if len(sys.argv) > 2 else "")
