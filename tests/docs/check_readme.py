#!/usr/bin/env python3
"""Keep README.md's first C++ example true: extract it, compile it, run it, expect exit 0.

usage: check_readme.py README.md INCLUDE_DIR OUT_DIR COMPILER [ARGS...]
"""
import os
import re
import subprocess
import sys

readme, inc, out_dir, cmd = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4:]
with open(readme, encoding="utf-8") as f:
    blocks = re.findall(r"^```cpp\n(.*?)^```$", f.read(), flags=re.S | re.M)
if not blocks:
    sys.exit("FAIL: README.md has no ```cpp block")
os.makedirs(out_dir, exist_ok=True)
src = os.path.join(out_dir, "readme_example.cpp")
exe = os.path.join(out_dir, "readme_example")
with open(src, "w", encoding="utf-8") as f:
    f.write(blocks[0])
build = subprocess.run(cmd + ["-std=c++20", "-O1", "-fconstexpr-ops-limit=1000000000", "-I", inc, src, "-o", exe],
                       capture_output=True, text=True, timeout=300)
if build.returncode != 0:
    sys.stderr.write(build.stderr[-4000:])
    sys.exit("FAIL: README.md's first C++ example does not compile")
run = subprocess.run([exe], capture_output=True, text=True, timeout=60)
if run.returncode != 0:
    sys.exit(f"FAIL: README.md's first C++ example exits with {run.returncode}")
print("ok: README.md's first C++ example compiles and runs")
