"""Every import goes down the floors of docs/architecture.md, read from the source with ast, no import.

Floors, top to bottom; a module may import its own floor or a lower one, never a higher one, and
the project's imports have no cycle; no command imports another, and a module of no command (the
command line aside) imports none, whatever floors their modules sit on (``COMMANDS``; today's
exceptions are listed as debt in ``COMMAND_IMPORTS_DEBT``):

    command line     parabench.cli, parabench.__main__
    commands         run.*, compare.*, env.*, plan.*, comm.command, convert.command,
                     parabench.migrate.* (bench migrate/smoke)
    processes        launchers, worker, loop, jobs (config or spec.json -> JobSpec: needs the adapter)
    backends         parabench.adapters.*
    building blocks  model, data, indexed, hf, devices, redirect, flops, metrics, tracking, plots, hydraconfig
    contract         spec, errors, parabench (the package: its version)

A project module is imported inside a function only where it is heavy: it imports, itself or through
the project modules it imports at module level, a framework that is slow to import or absent
(``HEAVY``). Everything else is imported at the top of the module, so the imports there show the
structure. One more place may import lazily: the cli imports the module of a command (the
commands floor) when that command runs, so ``bench --help`` loads none of them (all of them
together cost 0.5-0.7 s on a 2-core machine; tests/test_cli.py allows ``--help`` 0.5 s).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = {"bench": "parabench", "adapters": "parabench.adapters", "migrate": "parabench.migrate"}

FLOORS: list[tuple[str, tuple[str, ...]]] = [
    ("command line", ("parabench.cli", "parabench.__main__")),
    (
        "commands",
        (
            "parabench.run",  # the package: run.command, run.sweep, run.slurm, run.comm_report
            "parabench.sweep",  # run.sweep's callback under its former name, for queued Slurm jobs' pickles
            "parabench.compare",  # the package: compare.command, compare.versus
            "parabench.env",  # the package: env.command
            "parabench.migrate",
            "parabench.plan",
            "parabench.comm",  # the package: comm.command
            "parabench.convert",
        ),
    ),
    (
        "processes",
        (
            "parabench.launchers",
            "parabench.localrun",
            "parabench.k8s",
            "parabench.worker",
            "parabench.loop",
            "parabench.jobs",
            "parabench.resilience",  # the package: checkpoint, faults (its stability table is a building block)
            "parabench.comm.worker",
            "parabench.convert.worker",
            "parabench.convert.deepspeed_checkpoint",
            "parabench.convert.megatron_checkpoint",
            "parabench.convert.megatron_legacy",
            "parabench.runnames",
            "parabench.rundir",
        ),
    ),
    ("backends", ("parabench.adapters",)),
    (
        "building blocks",
        (
            "parabench.model",
            "parabench.data",
            "parabench.indexed",
            "parabench.hf",
            "parabench.devices",
            "parabench.redirect",
            "parabench.flops",
            "parabench.commvolume",
            "parabench.collectives",
            "parabench.commlog",
            "parabench.metrics",
            "parabench.expertload",
            "parabench.tracking",  # the package: tracking.runs, tracking.store
            "parabench.plots",
            "parabench.resilience.stability",
            "parabench.runtable",
            "parabench.hydraconfig",
            "parabench.canonical",
            "parabench.untrusted",
            "parabench.hostmem",
        ),
    ),
    ("contract", ("parabench.spec", "parabench.errors", "parabench")),
]

# The commands, by command: a module of one command imports building blocks (and the floors below),
# never another command's module - on whichever floor either sits (a command package keeps its
# per-rank worker on the processes floor: comm.worker, convert.worker). Every module of the commands
# floor belongs to one command; what two commands share belongs to none and imports none.
COMMANDS: dict[str, tuple[str, ...]] = {
    # run.sweep, run.slurm: Hydra's callback and launcher; run.comm_report: a run's communication,
    # measured vs formula; parabench.sweep: the callback's former name (queued Slurm jobs unpickle it)
    "run": ("parabench.run", "parabench.sweep"),
    "compare": ("parabench.compare",),  # compare.versus: bench plan's predictions vs the runs
    "env": ("parabench.env",),
    "migrate": ("parabench.migrate",),  # bench migrate and bench smoke
    "plan": ("parabench.plan",),
    "comm": ("parabench.comm",),
    "convert": ("parabench.convert",),
}

# (importer, imported) across commands that exist today: known debt that the "commands as packages"
# redesign of issue 27 removes (docs/architecture.md says so), each with what it takes and where it
# belongs. No new entry: a command needing another's code moves that code down to a building block.
COMMAND_IMPORTS_DEBT: dict[tuple[str, str], str] = {}

# Third-party packages that are slow to import, need hardware, or are optional extras.
HEAVY = {
    "torch",
    "torch_npu",
    "deepspeed",
    "megatron",
    "mindspore",
    "mindspeed",
    "mlflow",
    "hydra",
    "omegaconf",
    "libcst",
    "numpy",
    "safetensors",
    "transformers",
}

# (importer, imported): an exception to the rules above, each with the reason it must stay.
ALLOWED: dict[tuple[str, str], str] = {}


@dataclass(frozen=True)
class Import:
    source: str  # importing module
    target: str  # imported project module, or the top-level name of a third-party package
    line: int
    local: bool  # inside a function
    type_only: bool  # under ``if TYPE_CHECKING:``


def _modules() -> dict[str, Path]:
    mods = {}
    for folder, package in PACKAGES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = [p for p in path.relative_to(ROOT / folder).with_suffix("").parts if p != "__init__"]
            mods[".".join([package, *parts])] = path
    return mods


MODULES = _modules()


def _project_module(name: str) -> str | None:
    """The project module that ``name`` (a module, or module.attribute) is, or None."""
    if name != "parabench" and not name.startswith("parabench."):
        return None
    while name not in MODULES:
        name = name.rpartition(".")[0]
    return name


def _targets(node: ast.Import | ast.ImportFrom, module: str) -> list[str]:
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    base = node.module or ""
    if node.level:
        package = module if MODULES[module].name == "__init__.py" else module.rpartition(".")[0]
        for _ in range(node.level - 1):
            package = package.rpartition(".")[0]
        base = f"{package}.{base}" if base else package
    return [f"{base}.{a.name}" for a in node.names]


class _Visitor(ast.NodeVisitor):
    def __init__(self, module: str) -> None:
        self.module, self.imports, self._depth, self._type_only = module, [], 0, 0

    def visit_FunctionDef(self, node: ast.AST) -> None:
        self._depth += 1
        self.generic_visit(node)
        self._depth -= 1

    visit_AsyncFunctionDef = visit_Lambda = visit_FunctionDef

    def visit_If(self, node: ast.If) -> None:
        test = ast.unparse(node.test)
        type_only = test in ("TYPE_CHECKING", "typing.TYPE_CHECKING")
        self._type_only += type_only
        for child in node.body:
            self.visit(child)
        self._type_only -= type_only
        for child in node.orelse:
            self.visit(child)

    def _record(self, node: ast.Import | ast.ImportFrom) -> None:
        for name in _targets(node, self.module):
            target = _project_module(name) or name.partition(".")[0]
            self.imports.append(Import(self.module, target, node.lineno, self._depth > 0, self._type_only > 0))

    visit_Import = visit_ImportFrom = _record


def _imports() -> list[Import]:
    found = []
    for module, path in MODULES.items():
        visitor = _Visitor(module)
        visitor.visit(ast.parse(path.read_text(), str(path)))
        found += [i for i in visitor.imports if i.target != module]
    return found


IMPORTS = _imports()
PROJECT = [i for i in IMPORTS if i.target in MODULES]


def floor(module: str) -> int:
    """Index of the module's floor (0 = top); the longest matching prefix decides."""
    best, index = -1, None
    for i, (_, prefixes) in enumerate(FLOORS):
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, index = len(prefix), i
    assert index is not None, f"{module} is on no floor: add it to FLOORS (and docs/architecture.md)"
    return index


def _heavy_modules() -> set[str]:
    """Project modules that import a HEAVY package at module level, directly or through project modules."""
    runtime = [i for i in IMPORTS if not i.local and not i.type_only]
    heavy = {i.source for i in runtime if i.target in HEAVY}
    grew = True
    while grew:
        more = {i.source for i in runtime if i.target in heavy} - heavy
        heavy |= more
        grew = bool(more)
    return heavy


def _where(i: Import) -> str:
    return f"{MODULES[i.source].relative_to(ROOT)}:{i.line} {i.source} -> {i.target}"


def test_every_module_has_a_floor():
    for module in MODULES:
        floor(module)


def test_imports_go_down():
    up = [
        f"{_where(i)} (floor {FLOORS[floor(i.source)][0]} imports floor {FLOORS[floor(i.target)][0]})"
        for i in PROJECT
        if floor(i.target) < floor(i.source) and (i.source, i.target) not in ALLOWED
    ]
    assert not up, "imports that go up a floor:\n" + "\n".join(up)


def test_project_modules_are_imported_in_functions_only_when_heavy():
    heavy = _heavy_modules()
    cli, commands = floor("parabench.cli"), floor("parabench.run.command")
    hidden = [
        _where(i)
        for i in PROJECT
        if i.local
        and i.target not in heavy
        and (i.source, i.target) not in ALLOWED
        and not (floor(i.source) == cli and floor(i.target) == commands)
    ]
    assert not hidden, (
        "light project modules imported inside functions (import them at module level; "
        "only modules that pull in " + ", ".join(sorted(HEAVY)) + " may be imported lazily):\n" + "\n".join(hidden)
    )


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(edges):
        if v not in index:
            connect(v)
    return found


def test_no_import_cycles():
    """Module-level and function-local imports together (a lazy import hides a cycle, it does not
    remove it); ``TYPE_CHECKING`` imports are not executed and do not count."""
    edges: dict[str, set[str]] = {}
    for i in PROJECT:
        if not i.type_only and (i.source, i.target) not in ALLOWED:
            edges.setdefault(i.source, set()).add(i.target)
    assert not _cycles(edges), f"import cycles: {_cycles(edges)}"


@pytest.mark.parametrize(
    "edges, cycles",
    [
        ({"a": {"b"}, "b": {"a"}, "c": {"a"}}, [["a", "b"]]),
        ({"a": {"b"}, "b": {"c"}}, []),
    ],
)
def test_the_cycle_finder_finds_cycles(edges, cycles):
    assert _cycles(edges) == cycles


def test_the_floor_test_sees_upward_and_local_imports():
    code = "import os\nfrom parabench.cli import main\n\ndef f():\n    from parabench import errors\n"
    visitor = _Visitor("parabench.spec")
    visitor.visit(ast.parse(code))
    got = [(i.target, i.local) for i in visitor.imports]
    assert got == [("os", False), ("parabench.cli", False), ("parabench.errors", True)]
    assert floor("parabench.cli") < floor("parabench.spec")
    assert floor("parabench.adapters.megatron") == floor("parabench.adapters")
    assert floor("parabench.migrate.rules._py") == floor("parabench.run.command")


def test_every_allowance_still_matters():
    used = {(i.source, i.target) for i in PROJECT}
    assert not set(ALLOWED) - used, f"allowed imports that no longer exist: {set(ALLOWED) - used}"


# Functions a reader can hold: none over 60 lines in bench/ and adapters/ (issue #27), none over
# MAX_FUNCTION_LINES in migrate/, which may keep at most two longer engine functions, each listed here
# with the reason it stays whole ("path:qualified name" -> why). None needs it today.
MAX_FUNCTION_LINES = 80
MAX_HARNESS_FUNCTION_LINES = 60  # bench/ and adapters/
LONG_FUNCTIONS_ALLOWED: dict[str, str] = {}


def _function_lengths(package: str):
    """(``path:Class.function``, lines from ``def`` to the last line of the body) for every function."""
    for path in sorted((ROOT / package).rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        stack = [(node, "") for node in ast.parse(path.read_text()).body]
        while stack:
            node, prefix = stack.pop()
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{node.name}"
                if not isinstance(node, ast.ClassDef):
                    yield f"{rel}:{name}", node.end_lineno - node.lineno + 1
                stack.extend((child, f"{name}.") for child in ast.iter_child_nodes(node))


def test_no_function_is_longer_than_a_reader_can_hold():
    assert len(LONG_FUNCTIONS_ALLOWED) <= 2 and all(k.startswith("migrate/") for k in LONG_FUNCTIONS_ALLOWED)
    limits = {
        "bench": MAX_HARNESS_FUNCTION_LINES,
        "adapters": MAX_HARNESS_FUNCTION_LINES,
        "migrate": MAX_FUNCTION_LINES,
    }
    too_long = [
        f"{name} ({n} lines, at most {limit})"
        for package, limit in limits.items()
        for name, n in _function_lengths(package)
        if n > limit and name not in LONG_FUNCTIONS_ALLOWED
    ]
    assert not too_long, f"functions over their limit (split them): {too_long}"
    unused = [k for k in LONG_FUNCTIONS_ALLOWED if k not in dict(_function_lengths("migrate"))]
    assert not unused, f"allowed long functions that no longer exist: {unused}"


def command(module: str) -> str | None:
    """The command a module belongs to, whatever its floor (the longest matching prefix), else None."""
    best, name = -1, None
    for cmd, prefixes in COMMANDS.items():
        for prefix in prefixes:
            if (module == prefix or module.startswith(prefix + ".")) and len(prefix) > best:
                best, name = len(prefix), cmd
    return name


def _cross_command(imports: list[Import]) -> list[Import]:
    """Imports from a module of one command into a module of another, whatever floors they sit on."""
    return [i for i in imports if command(i.source) and command(i.target) and command(i.source) != command(i.target)]


def _shared_into_command(imports: list[Import]) -> list[Import]:
    """Imports from a module of no command (the command line aside: it dispatches to the commands)
    into a module of a command, whatever floor it sits on."""
    cli = floor("parabench.cli")
    return [i for i in imports if command(i.source) is None and floor(i.source) != cli and command(i.target)]


def test_every_command_is_a_package():
    """A command's modules are one package, bench/<command>/ (or migrate/); the one flat name is the
    sweep callback's former name, kept for the pickles of queued Slurm jobs (bench/sweep.py)."""
    flat = [p for prefixes in COMMANDS.values() for p in prefixes if MODULES[p].name != "__init__.py"]
    assert flat == ["parabench.sweep"], f"commands of flat modules (make them packages): {flat}"


def test_every_module_of_the_commands_floor_belongs_to_a_command():
    commands = floor("parabench.run.command")
    homeless = [m for m in MODULES if floor(m) == commands and command(m) is None]
    assert not homeless, f"commands-floor modules of no command (add them to COMMANDS): {homeless}"


def test_no_command_imports_another():
    found = [
        f"{_where(i)} (command {command(i.source)} imports command {command(i.target)})"
        for i in _cross_command(PROJECT)
        if (i.source, i.target) not in COMMAND_IMPORTS_DEBT
    ]
    assert not found, (
        "a command imports another command's module (move what both need to a building block):\n" + "\n".join(found)
    )


def test_shared_modules_import_no_command():
    found = [f"{_where(i)} (imports command {command(i.target)})" for i in _shared_into_command(PROJECT)]
    assert not found, (
        "a module of no command imports a command's module (what is shared moves down, out of the command):\n"
        + "\n".join(found)
    )


def _seen(module: str, code: str, check) -> list[tuple[str, str | None]]:
    visitor = _Visitor(module)
    visitor.visit(ast.parse(code))
    return [(i.target, command(i.target)) for i in check(visitor.imports)]


def test_the_command_test_sees_a_command_importing_another():
    code = "from parabench.run.command import execute\nfrom parabench import spec\n\ndef f():\n    from parabench.plan import search\n"
    crossing = [("parabench.run.command", "run"), ("parabench.plan.search", "plan")]
    assert _seen("parabench.convert", code, _cross_command) == crossing
    # a command package's module below the commands floor, into another's: not one floor, still seen
    code = "from parabench.convert.worker import main\nfrom parabench.comm import command\nfrom parabench import loop\n"
    assert floor("parabench.comm.worker") > floor("parabench.comm.command")
    assert _seen("parabench.comm.worker", code, _cross_command) == [("parabench.convert.worker", "convert")]
    shared = [("parabench.convert.worker", "convert"), ("parabench.comm.command", "comm")]
    assert _seen("parabench.loop", code, _shared_into_command) == shared
    assert _seen("parabench.cli", code, _shared_into_command) == []  # the command line dispatches to commands
    assert command("parabench.migrate.rules._py") == "migrate" and command("parabench.run.comm_report") == "run"
    assert command("parabench.commlog") is None  # a prefix is a module or package, not a spelling


def test_every_command_debt_still_exists():
    crossing = {(i.source, i.target) for i in _cross_command(PROJECT)}
    stale = set(COMMAND_IMPORTS_DEBT) - crossing
    assert not stale, f"paid-off command-import debt, drop it from COMMAND_IMPORTS_DEBT: {sorted(stale)}"


def test_a_job_carries_its_adapter_and_spec_json_does_not():
    """The adapter is resolved once where the job is composed (parabench.jobs); spec.json keeps the name."""
    import json

    from parabench.adapters.registry import get_adapter
    from parabench.hydraconfig import compose, to_plain
    from parabench.jobs import from_config, job_from_json

    job = from_config(to_plain(compose(["+model=llama", "backend=fsdp"])))
    assert job.backend.adapter is get_adapter("fsdp")
    assert set(json.loads(job.to_json())["backend"]) == {"name", "options"}
    assert job_from_json(job.to_json()) == job and job_from_json(job.to_json()).backend.adapter is job.backend.adapter


# Where a backend's adapter is looked up by name: the registry (its own helpers: every adapter, the
# plan profiles, the comm stacks, a recorded backend's capabilities) and the job's composition, which
# hands the job its adapter (``job.backend.adapter``). Everything else reads one of those.
ADAPTER_LOOKUPS = {"adapters/registry.py", "bench/jobs.py"}


def _adapter_lookups(path: Path) -> list[int]:
    """Lines of ``path`` that call ``get_adapter(...)`` (by name or as an attribute)."""
    return [
        node.lineno
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.Call)
        and (getattr(node.func, "id", None) == "get_adapter" or getattr(node.func, "attr", None) == "get_adapter")
    ]


def test_adapters_are_looked_up_by_name_only_in_the_registry_and_the_job_composition():
    found = [
        f"{path.relative_to(ROOT).as_posix()}:{line}"
        for package in ("bench", "adapters", "migrate")
        for path in sorted((ROOT / package).rglob("*.py"))
        if path.relative_to(ROOT).as_posix() not in ADAPTER_LOOKUPS
        for line in _adapter_lookups(path)
    ]
    assert not found, (
        "get_adapter( outside the registry and parabench.jobs: read job.backend.adapter, or a registry helper "
        "(adapters(), plan_profiles(), comm_stacks(), capabilities(name)):\n" + "\n".join(found)
    )
    assert all(_adapter_lookups(ROOT / p) for p in ADAPTER_LOOKUPS), "a listed lookup site no longer looks up"


def test_every_standalone_torch_worker_script_destroys_its_process_group():
    """The scripts tests and benchmarks start under torchrun (tests/*_train.py, benchmarks/native/*) end by
    destroying their process group, as parabench's own workers do (adapters/base.py): one that exits
    holding it tears gloo's threads down in interpreter shutdown, where CI saw a rank abort (SIGABRT,
    'terminate called without an active exception') after its work was done."""
    scripts = [*ROOT.glob("tests/*_train.py"), *ROOT.glob("benchmarks/native/*_native.py")]
    torch_scripts = [p for p in scripts if "init_process_group" in p.read_text() or "init_distributed" in p.read_text()]
    assert len(torch_scripts) >= 5, [p.name for p in scripts]
    missing = [p.name for p in torch_scripts if "destroy_process_group()" not in p.read_text()]
    assert not missing, f"exit holding a process group: {missing}"


def test_an_engine_has_the_roles_its_adapter_declares():
    """The engine interface is split into roles (adapters/base.py); the capabilities an adapter declares
    name the roles its engine must have, checked where a worker builds it (worker, convert.worker)."""
    from dataclasses import replace

    from parabench.adapters.base import (
        Accounting,
        CanonicalIO,
        Checkpointing,
        Engine,
        Stepping,
        check_roles,
        declared_roles,
    )
    from parabench.adapters.ddp import DDPAdapter

    class Steps(Engine):
        def train_step(self, micro_batches):
            return 0.0

        def full_state_dict(self):
            return {}

        def model_state_bytes(self):
            raise NotImplementedError

    class Saves(Steps, Checkpointing):
        def save_checkpoint(self, directory, *, async_save=False):
            pass

        def load_checkpoint(self, directory):
            pass

    with pytest.raises(TypeError, match=r"engine Steps lacks the role\(s\) Checkpointing, CanonicalIO"):
        check_roles(DDPAdapter, Steps())
    with pytest.raises(TypeError, match=r"lacks the role\(s\) CanonicalIO its capabilities declare"):
        check_roles(DDPAdapter, Saves())
    caps = DDPAdapter.capabilities
    assert declared_roles(caps) == (Engine, Checkpointing, CanonicalIO)
    assert declared_roles(replace(caps, checkpoint=None, convert=None)) == (Engine,)
    check_roles(type("Plain", (DDPAdapter,), {"capabilities": replace(caps, checkpoint=None, convert=None)}), Steps())
    # the roles split the interface: no method belongs to two
    methods = [
        {m for m in vars(role) if not m.startswith("_")} for role in (Stepping, Accounting, Checkpointing, CanonicalIO)
    ]
    assert sum(map(len, methods)) == len(set().union(*methods)) == 14, methods
