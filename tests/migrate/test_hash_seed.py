"""Findings do not depend on the process's string-hash seed (set iteration order).

A name bound by two imports resolves to both qualified names; rules must not pick "whichever the
set yields first" (DeepSpeed's op builder binds CppExtension / CUDAExtension as one name).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

SOURCE = """import torch


def build(use_cuda):
    if use_cuda:
        from torch.utils.cpp_extension import CUDAExtension as Ext
    else:
        from torch.utils.cpp_extension import CppExtension as Ext
    if use_cuda:
        from torch.backends import cudnn as flags
    else:
        from torch.backends import cuda as flags
    flags.allow_tf32 = True
    return Ext(name="op", sources=["op.cpp"])
"""

PROBE = """
import dataclasses, json, sys
from parabench.migrate.core import Options
from parabench.migrate.engine import migrate_text
new, findings, reason = migrate_text("python", sys.stdin.read(), "op.py", Options())
print(json.dumps([new, [dataclasses.astuple(f) for f in findings], reason]))
"""


def test_same_result_under_every_hash_seed():
    results = set()
    for seed in ("0", "1", "2", "3", "4"):
        env = dict(os.environ, PYTHONHASHSEED=seed)
        out = subprocess.run(
            [sys.executable, "-c", PROBE], input=SOURCE, env=env, capture_output=True, text=True, check=True
        )
        results.add(out.stdout)
    assert len(results) == 1, "findings depend on PYTHONHASHSEED"
    new, findings, reason = json.loads(results.pop())
    assert any(f[0] == "PY906" for f in findings), findings  # CUDAExtension is one of the names: reported
