"""The pre-filter's names (migrate/parse_plan.py ``_CODE_WORDS``): a name that only contains a
rule's word leaves the file to the copy without LibCST; the forms the rules resolve still reach them.

Megatron-Core calls ``get_data_parallel_group()`` and DeepSpeed ``get_accelerator()`` in most
files and ``re.compile`` is everywhere: as trigger words they had LibCST parse a third of the
corpus's files for nothing. PY905 resolves only torch.nn[.parallel].DataParallel and
torch.nn.parallel.data_parallel, PY909 only torch.compile, PY912 the string 'gpu'/'cuda' of an
``accelerator=`` keyword.
"""

from __future__ import annotations

import pytest

from parabench.migrate import apply_rules, parse_plan
from parabench.migrate.core import Options

FILLER = "".join(f"\n\ndef plain_{i}(x):\n    return [v * 2 for v in x]\n" for i in range(4))

# files no rule changes or reports: the pre-filter must not hand them to LibCST
NOT_PARSED = {
    "megatron_groups": "from megatron.core import parallel_state\n{filler}\n"
    "def reduce(t):\n    return parallel_state.get_data_parallel_group(), parallel_state.get_data_parallel_world_size()\n",
    "deepspeed_accelerator": "from deepspeed.accelerator import get_accelerator\n{filler}\n"
    "def device():\n    return get_accelerator().current_device_name()\n",
    "regex_compile": "import re\nimport torch\n{filler}\nPATTERN = re.compile(r'layer_(\\d+)')\n"
    "def model_compile(model):\n    return model.compile()\n",
    "torch_compiler_module": "import torch\n{filler}\n@torch.compiler.disable\ndef f(x):\n    return x\n",
    "ddp_is_no_data_parallel": "from torch.nn.parallel import DistributedDataParallel as DDP\n{filler}\n"
    "def wrap(m):\n    return DDP(m)\n",
}

# what the rules resolve: each case must still give its finding, partial parse == whole-file parse
REACHED = {
    "nn_data_parallel": ("import torch.nn as nn\n{filler}\ndef wrap(m):\n    return nn.DataParallel(m)\n", "PY905"),
    "data_parallel_import": (
        "from torch.nn.parallel import data_parallel as dp\n{filler}\ndef run(m, x):\n    return dp(m, x)\n",
        "PY905",
    ),
    "torch_compile": ("import torch\n{filler}\ndef fast(m):\n    return torch.compile(m)\n", "PY909"),
    "torch_alias_compile": (
        "{filler}\ndef fast(m):\n    import torch as th\n\n    return th.compile(m)\n",
        "PY909",
    ),
    "torch_unimported_compile": ("{filler}\n@torch.compile\ndef f(x):\n    return x\n", "PY909"),
    "compile_imported": (
        "from torch import compile as jit\n{filler}\ndef fast(m):\n    return jit(m)\n",
        "PY909",
    ),
    "lightning_gpu": (
        "import lightning as L\n{filler}\ntrainer = L.Trainer(accelerator='gpu', devices=8)\n",
        "PY912",
    ),
}


def _text(template: str) -> str:
    return template.replace("{filler}", FILLER)


@pytest.mark.parametrize("name", sorted(NOT_PARSED))
def test_names_that_only_contain_a_word_need_no_parse(name):
    text = _text(NOT_PARSED[name])
    assert not parse_plan.prefilter(text, Options()).need
    # and indeed no rule finds anything there when the whole file is parsed
    new, findings, _full, reason = apply_rules.migrate_python(text, "x.py", Options(), partial=False)
    assert (new, findings, reason) == (text, [], "")


@pytest.mark.parametrize("target", ["npu", "mindspeed"])
@pytest.mark.parametrize("name", sorted(REACHED))
def test_the_forms_the_rules_resolve_still_reach_them(name, target):
    template, rule = REACHED[name]
    text, options = _text(template), Options(target=target)
    partial = apply_rules.migrate_python(text, "x.py", options)
    assert rule in {f.rule for f in partial[1]}
    assert partial == apply_rules.migrate_python(text, "x.py", options, partial=False)
