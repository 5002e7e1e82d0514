#!/usr/bin/env python3
"""Screenshot every SVG of a folder in headless Chromium, and check each PNG is a real picture.

  python3 bench/paper/screenshot.py build/paper                      # PNG beside each SVG
  python3 bench/paper/screenshot.py --run build/bench/paper/paper_figures OUT_DIR   # draw, then shoot

Exit status: 0 all shot; 1 a figure is missing, Chromium failed or a PNG is blank; 77 Chromium
is not installed (Meson reports SKIP). Python standard library only.
"""
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile
import zlib


def chromium():
    for name in ("chromium", "chromium-browser", "google-chrome"):
        path = shutil.which(name)
        if path:
            return path
    return None


def png_size_and_colours(path):
    """(width, height, distinct colours in a sample of rows) of an 8-bit RGB(A) PNG."""
    data = open(path, "rb").read()
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        return 0, 0, 0
    pos, idat, w, h, ctype = 8, b"", 0, 0, 0
    while pos < len(data):
        n, kind = struct.unpack(">I4s", data[pos:pos + 8])
        body = data[pos + 8:pos + 8 + n]
        if kind == b"IHDR":
            w, h, depth, ctype = struct.unpack(">IIBB", body[:10])
        elif kind == b"IDAT":
            idat += body
        pos += 12 + n
    bpp = {2: 3, 6: 4}.get(ctype)
    if not bpp:
        return w, h, 2  # not RGB(A): cannot sample, but it is a picture
    raw = zlib.decompress(idat)
    stride = w * bpp + 1
    colours, prev = set(), bytearray(w * bpp)
    for y in range(h):
        f, line = raw[y * stride], bytearray(raw[y * stride + 1:(y + 1) * stride])
        for i in range(len(line)):  # undo the PNG filters
            a = line[i - bpp] if i >= bpp else 0
            b, c = prev[i], prev[i - bpp] if i >= bpp else 0
            if f == 1: line[i] = (line[i] + a) & 255
            elif f == 2: line[i] = (line[i] + b) & 255
            elif f == 3: line[i] = (line[i] + (a + b) // 2) & 255
            elif f == 4:
                p = a + b - c
                pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
                line[i] = (line[i] + (a if pa <= pb and pa <= pc else b if pb <= pc else c)) & 255
        if y % 7 == 0:
            for x in range(0, w, 3):
                colours.add(bytes(line[x * bpp:x * bpp + 3]))
        prev = line
    return w, h, len(colours)


def main(argv):
    args = argv[1:]
    exe = None
    if args[:1] == ["--run"]:
        exe, args = args[1], args[2:]
    if len(args) != 1:
        print(__doc__)
        return 2
    folder = args[0]
    browser = chromium()
    if browser is None:
        print("chromium is not installed: skipped (apt-get install chromium)")
        return 77
    if exe:
        os.makedirs(folder, exist_ok=True)
        p = subprocess.run([exe, "--out-dir", folder], capture_output=True, text=True, timeout=300)
        print(p.stdout)
        if p.returncode != 0:
            print(f"{exe} failed: {p.stderr}")
            return 1
    svgs = sorted(f for f in os.listdir(folder) if f.endswith(".svg"))
    if not svgs:
        print(f"no SVG in {folder}")
        return 1
    bad = []
    for name in svgs:
        svg = os.path.join(folder, name)
        text = open(svg).read()
        m = re.search(r'<svg[^>]*width="([\d.]+)"[^>]*height="([\d.]+)"', text)
        w, h = (int(float(m.group(1))), int(float(m.group(2)))) if m else (1200, 800)
        png = svg[:-4] + ".png"
        if os.path.exists(png):
            os.remove(png)
        with tempfile.TemporaryDirectory() as profile:
            p = subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                                f"--user-data-dir={profile}", f"--window-size={w},{h}", f"--screenshot={os.path.abspath(png)}",
                                "file://" + os.path.abspath(svg)], capture_output=True, text=True, timeout=120)
        if not os.path.exists(png):
            bad.append(f"{name}: chromium wrote no PNG (exit {p.returncode}): {p.stderr[-300:]}")
            continue
        pw, ph, colours = png_size_and_colours(png)
        # A figure has a white background, black text and several coloured series.
        if pw < 300 or ph < 200 or colours < 8:
            bad.append(f"{name}: PNG {pw}x{ph} with {colours} colours looks blank")
        else:
            print(f"{png}: {pw}x{ph}, {colours} colours sampled")
    for b in bad:
        print("FAIL", b)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
