"""Prints the include directory holding cudnn_frontend.h (NVIDIA's nvidia-cudnn-frontend
package), or exits 1. Looked for, in order: $CUDNN_FRONTEND_INCLUDE, the --target directory
scripts/dev.sh installs into, and every site-packages directory of this Python (pip puts the
package's headers in <site-packages>/include)."""
import os
import site
import sys

candidates = [os.environ.get("CUDNN_FRONTEND_INCLUDE", ""), "/usr/local/lib/cudnn-frontend/include"]
candidates += [os.path.join(p, "include") for p in site.getsitepackages() + [site.getusersitepackages()] + sys.path]
for d in candidates:
    if d and os.path.isfile(os.path.join(d, "cudnn_frontend.h")):
        print(d)
        sys.exit(0)
sys.exit(1)
