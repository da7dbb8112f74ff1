"""Entry points of a project, for ``--mode runtime`` (RT001 imports transfer_to_npu there).

A process starts Python code in three ways that a tree shows without running anything:
launch scripts (``python X.py``, ``python -m pkg.mod``, ``torchrun ... X.py``,
``deepspeed X.py``, ``accelerate launch X.py``, ``python -m torch.distributed.run ... X.py``),
console scripts declared by the package (``[project.scripts]`` in pyproject.toml,
``console_scripts`` in setup.cfg / setup.py), and a module that trains at its top level without a
``__main__`` guard (nanoGPT's ``train.py``: ``loss.backward()`` in a top-level loop). Files with a
``__main__`` guard are entry points by themselves (``rt001_transfer_to_npu.is_entry``).

Nothing here imports or runs the project: shell lines are split with ``shlex``, TOML/INI files
read with ``tomllib``/``configparser``, ``setup.py`` and modules parsed with ``ast``.
"""

from __future__ import annotations

import ast
import configparser
import posixpath
import re
import shlex

import tomllib

# words that start a Python process running a script/module given later on the line
LAUNCHERS = ("torchrun", "deepspeed", "accelerate", "colossalai", "mpirun", "srun", "horovodrun")
_PYTHON = re.compile(r"^(?:.*/)?python(?:\d+(?:\.\d+)?)?$")
_PY_FLAGS_WITH_VALUE = frozenset({"-W", "-X", "--check-hash-based-pycs"})
_LAUNCHER_MODULES = ("torch.distributed.", "deepspeed.launcher", "accelerate.commands")
# calls that only training code makes at top level (attribute names; receivers checked for `step`)
_TRAINING_ATTRS = frozenset({"backward", "zero_grad", "init_process_group"})
_STEP_RECEIVERS = ("optim", "opt", "scaler", "sched", "engine", "model_engine")


def find_entries(texts: dict[str, str], python_files: list[str]) -> dict[str, str]:
    """Entry points among ``python_files`` (paths relative to the source root, posix) named by the
    launch scripts and package metadata in ``texts`` (rel path -> text of every shell script,
    pyproject.toml, setup.cfg and setup.py of the tree) -> {python file: why}."""
    found: dict[str, str] = {}
    for rel, text in sorted(texts.items()):
        name = posixpath.basename(rel)
        if name == "pyproject.toml":
            refs = [(f"[project.scripts] in {rel}", _module_path(m)) for m in _pyproject_scripts(text)]
        elif name == "setup.cfg":
            refs = [(f"console_scripts in {rel}", _module_path(m)) for m in _setup_cfg_scripts(text)]
        elif name == "setup.py":
            refs = [(f"console_scripts in {rel}", _module_path(m)) for m in _setup_py_scripts(text)]
        else:
            refs = [(f"`{cmd}` in {rel}:{line}", path) for line, cmd, path in launch_targets(text)]
        for why, path in refs:
            for target in _resolve(path, posixpath.dirname(rel), python_files):
                found.setdefault(target, why)
    return found


def launch_targets(text: str) -> list[tuple[int, str, str]]:
    """(line, command, path) for each Python script or module a shell text launches; a module
    ``pkg.mod`` is given as the path ``pkg/mod`` (no suffix)."""
    out = []
    lines = text.split("\n")
    k = 0
    while k < len(lines):
        start, logical = k + 1, lines[k]
        while logical.endswith("\\") and k + 1 < len(lines):  # continuation lines
            k += 1
            logical = logical[:-1] + " " + lines[k]
        k += 1
        code = logical.split("#", 1)[0] if not logical.lstrip().startswith("#") else ""
        if not code.strip() or "python" not in code and not any(w in code for w in LAUNCHERS):
            continue
        for segment in re.split(r"&&|\|\||;|\|", code):
            target = _segment_target(segment)
            if target is not None:
                shown = target if target.endswith(".py") else "-m " + target.replace("/", ".")
                out.append((start, f"{segment.split()[0]} ... {shown}", target))
    return out


def _segment_target(segment: str) -> str | None:
    try:
        words = shlex.split(segment)
    except ValueError:  # unbalanced quotes: fall back to whitespace
        words = segment.split()
    python = next((i for i, w in enumerate(words) if _PYTHON.match(w)), None)
    if python is not None:  # also `srun python ...`, `mpirun -np 8 python ...`
        return _python_target(words[python + 1 :])
    launcher = next((i for i, w in enumerate(words) if posixpath.basename(w) in LAUNCHERS), None)
    if launcher is None:
        return None
    return _python_target(["-"] + words[launcher + 1 :], launched=True)


def _python_target(args: list[str], *, launched: bool = False) -> str | None:
    """What ``python ARGS`` runs: a script path, ``pkg/mod`` for ``-m pkg.mod``; for the torch /
    deepspeed launcher modules, the script they launch. ``launched``: ARGS follow a launcher
    (torchrun, deepspeed, ...), whose own options may take values: the first ``*.py`` is the script."""
    if launched:
        module = next((args[k + 1] for k, a in enumerate(args[:-1]) if a in ("-m", "--module")), None)
        if module is not None and not module.endswith(".py"):
            return None if module.startswith(_LAUNCHER_MODULES) else module.replace(".", "/")
        script = next((x for x in args if x.endswith(".py")), None)
        return _strip_vars(script) if script else None
    i = 0
    while i < len(args):
        a = args[i]
        if a == "-m" and i + 1 < len(args):
            module = args[i + 1]
            if module.startswith(_LAUNCHER_MODULES):
                script = next((x for x in args[i + 2 :] if x.endswith(".py")), None)
                return _strip_vars(script) if script else None
            return module.replace(".", "/")
        if a == "-c":
            return None
        if a in _PY_FLAGS_WITH_VALUE:
            i += 2
            continue
        if a.startswith("-"):
            i += 1
            continue
        return _strip_vars(a) if a.endswith(".py") else None
    return None


def _strip_vars(path: str) -> str:
    """``$ROOT/tools/train.py`` / ``${DIR}/train.py`` -> ``tools/train.py`` / ``train.py``."""
    parts = [p for p in path.split("/") if p not in ("", ".")]
    while parts and "$" in parts[0]:
        parts.pop(0)
    return "/".join(p for p in parts if "$" not in p)


def _module_path(spec: str) -> str:
    """``pkg.cli:main`` -> ``pkg/cli``."""
    return spec.split(":", 1)[0].strip().replace(".", "/")


def _pyproject_scripts(text: str) -> list[str]:
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError:
        return []
    project = data.get("project", {})
    poetry = data.get("tool", {}).get("poetry", {})
    tables = [project.get("scripts", {}), project.get("gui-scripts", {}), poetry.get("scripts", {})]
    return [v for t in tables if isinstance(t, dict) for v in t.values() if isinstance(v, str)]


def _setup_cfg_scripts(text: str) -> list[str]:
    parser = configparser.ConfigParser(interpolation=None)
    try:
        parser.read_string(text)
    except configparser.Error:
        return []
    raw = parser.get("options.entry_points", "console_scripts", fallback="")
    return [line.split("=", 1)[1] for line in raw.splitlines() if "=" in line]


def _setup_py_scripts(text: str) -> list[str]:
    try:
        tree = ast.parse(text)
    except (SyntaxError, ValueError):
        return []
    out = []
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            try:
                value = ast.literal_eval(node.value)
            except ValueError:
                continue
            scripts = value.get("console_scripts", []) if isinstance(value, dict) else []
            scripts = [scripts] if isinstance(scripts, str) else scripts
            out += [s.split("=", 1)[1] for s in scripts if isinstance(s, str) and "=" in s]
    return out


def _resolve(path: str, script_dir: str, python_files: list[str]) -> list[str]:
    """The files of the tree ``path`` can mean: relative to the root, to the launch script's
    directory, else every file whose path ends with it (``src/`` layouts, ``cd`` in scripts)."""
    if not path or posixpath.basename(path) == "setup.py":  # `python setup.py ...` builds, it does not train
        return []
    stem = path[:-3] if path.endswith(".py") else path
    names = [f"{stem}.py"] if path.endswith(".py") else [f"{stem}.py", f"{stem}/__main__.py", f"{stem}/__init__.py"]
    files = set(python_files)
    for base in ("", script_dir):
        hit = [posixpath.normpath(posixpath.join(base, n)) for n in names]
        hit = [h for h in hit if h in files]
        if hit:
            return hit[:1]
    tails = [n.lstrip("/") for n in names]
    return sorted(f for f in python_files if any(f == t or f.endswith("/" + t) for t in tails))[:4]


def top_level_training(tree: ast.Module) -> str:
    """Why a module without a ``__main__`` guard is a training script: the first training call it
    makes at top level (outside functions and classes), e.g. "top-level training code (line 80:
    loss.backward())"; "" when it makes none."""
    stack = list(reversed(tree.body))
    while stack:
        node = stack.pop()
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Lambda)):
            continue
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
            attr, receiver = node.func.attr, node.func.value
            name = receiver.id if isinstance(receiver, ast.Name) else getattr(receiver, "attr", "")
            if attr in _TRAINING_ATTRS or attr == "step" and name.lower().startswith(_STEP_RECEIVERS):
                return f"top-level training code (line {node.lineno}: {ast.unparse(node)[:60]})"
        stack.extend(reversed(list(ast.iter_child_nodes(node))))
    return ""


def may_train_at_top_level(text: str) -> bool:
    """Cheap text test before parsing: could ``text`` hold a top-level training call?"""
    return "backward" in text or "zero_grad" in text or ".step(" in text or "init_process_group" in text
