"""Timing this checkout's code against another checkout's in the same run: each tree in a child process.

A benchmark run with ``--baseline-tree PATH`` measures the baseline (e.g. the previous commit, extracted with
``git archive``) and this tree with the same inputs, one child process each, so that neither imports the
other's modules. The child runs the benchmark's own module with ``--in-tree TREE``: it puts TREE first on
``sys.path`` before importing the engine it measures, and writes its rows as JSON.
"""

from __future__ import annotations

import importlib
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[1]


def run_in_tree(module: str, tree: Path, args: list[str]) -> dict:
    """``python -m module --in-tree TREE ARGS --json FILE`` in a child process; its JSON."""
    with tempfile.NamedTemporaryFile(suffix=".json") as out:
        env = os.environ | {"PYTHONUNBUFFERED": "1"}
        subprocess.run([sys.executable, "-m", module, "--in-tree", str(tree), *args, "--json", out.name], cwd=REPO,
                       env=env, check=True)
        return json.loads(Path(out.name).read_text())


def without_options(argv: list[str], options: tuple[str, ...]) -> list[str]:
    """A command line less the given options and their values (what a child process is not to get)."""
    out, skip = [], False
    for arg in argv:
        if skip and not arg.startswith("--"):
            continue
        skip = arg.split("=")[0] in options
        if not skip:
            out.append(arg)
    return out


def import_from(tree: Path, name: str) -> ModuleType:
    """Module ``name`` of ``tree`` (which goes first on sys.path: call before anything imports the package)."""
    if str(tree) not in sys.path[:1]:
        sys.path.insert(0, str(tree))
    return importlib.import_module(name)


def git_sha() -> str:
    """The commit measured: $KIVI_GIT_SHA where a copy of the tree has no (or a stale) .git, else HEAD."""
    if sha := os.environ.get("KIVI_GIT_SHA"):
        return sha
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=REPO).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "uncommitted"
