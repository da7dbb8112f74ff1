"""Print the identity of the torch installed for this interpreter, without importing it.

    PYTHON benchmarks/torch_fingerprint.py

Version, a hash of its RECORD (every installed file's hash) and the inode + mtime of its core
library, so that a reinstall of the same version is caught too. compat_matrix.sh and gpu_check.sh
compare it before and after installing parabench: the install must leave torch untouched.
Exit status 1 when no torch distribution is installed.
"""

import hashlib
import importlib.metadata as md
import os
import sys

try:
    dist = md.distribution("torch")
except md.PackageNotFoundError:
    sys.exit(f"torch_fingerprint: no torch installed for {sys.executable}")
lib = next(f for f in dist.files or [] if f.name.startswith("libtorch_cpu"))
st = os.stat(dist.locate_file(lib))
record = hashlib.sha256((dist.read_text("RECORD") or "").encode()).hexdigest()[:16]
print(dist.version, record, st.st_ino, int(st.st_mtime))
