"""Finding lines from the innermost statement's code generation (PyContext.lines descending into
class, function and compound-statement blocks) equal the lines of one pass over the whole module."""

from __future__ import annotations

import ast
import random
from pathlib import Path

import libcst as cst
import pytest

from parabench.migrate.core import Options
from parabench.migrate.libcst_private import line_table
from parabench.migrate.rules._py import Layout, PyContext

NESTED = """\
import torch


@decorator(
    x=1,
)
class Trainer:
    # a comment

    def step(self, batch):  # header comment
        # leading comment
        if torch.cuda.is_available():
            x = batch.cuda()
        elif batch is None:
            return None
        else:
            # else comment

            y = torch.cuda.current_device()
        for i in range(3):
            with torch.cuda.device(i):
                torch.cuda.synchronize()
        else:
            pass
        while False:
            break
        else:
            z = 1
        try:
            torch.cuda.empty_cache()
        except (RuntimeError,
                ValueError) as exc:
            # handler comment
            raise exc
        except Exception:
            pass
        else:
            w = torch.cuda.device_count()
        finally:
            torch.cuda.synchronize()
        async def inner():
            async with ctx() as c:
                async for q in c:
                    if q: await q.cuda()
        return torch.tensor([1,
                             2]).cuda()


def f(a,
      b):
    if a: b.cuda()
    if a:
        if b:
            if a and b:
                return torch.cuda.is_available()
    return [
        torch.cuda.current_device()
        for _ in range(2)
    ]
"""


def _check(text: str, sample: int | None = None) -> int:
    module = cst.parse_module(text)
    layout = Layout.build(module, ast.parse(text), lines=text.split("\n"))
    assert layout is not None
    whole = line_table(module)
    ctx = PyContext(module, Options(), frozenset(), layout)
    nodes = ctx.order[1:]  # the nodes a rule can ask about (whitespace and comments are not walked)
    if sample is not None and len(nodes) > sample:
        nodes = random.Random(0).sample(nodes, sample)
    for node in nodes:
        ctx._pos, ctx._pos_full = {}, False  # nothing cached: each query descends on its own
        assert ctx.lines(node) == whole[node], (type(node).__name__, module.code_for_node(node)[:80])
    return len(nodes)


def test_lines_inside_compound_statements():
    assert _check(NESTED) > 250


_SITE = Path(cst.__file__).resolve().parents[1]


@pytest.mark.parametrize(
    "rel",
    ["megatron/core/optimizer/distrib_optimizer.py", "megatron/core/utils.py", "deepspeed/runtime/engine.py"],
)
def test_lines_in_installed_modules(rel: str):
    path = _SITE / rel
    if not path.exists():
        pytest.skip(f"{rel} is not installed")
    assert _check(path.read_text(encoding="utf-8"), sample=400) > 100
