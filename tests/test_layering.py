"""The layers stay what DESIGN.md says: every module of cache/ and of the router
core imports neither torch nor ray (nor transformers); every module of the
worker core imports no ray. Modules are enumerated from the packages, so a new
file is covered the day it lands; the Ray adapters are the named exceptions.

Each layer is checked in a fresh interpreter that imports its modules one by
one and names the first module after which a forbidden package is loaded.
"""

from __future__ import annotations

import pkgutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

# The Ray Serve adapters: the only modules that may import ray.
RAY_ADAPTERS = {"router.serve", "router.serve_decisions", "worker.replica", "worker.stats_board", "worker.kv_transport"}

LAYERS = {
    "cache": (("cache",), ("torch", "ray", "transformers")),
    "router core": (("router",), ("torch", "ray", "transformers")),
    "worker core": (("worker",), ("ray",)),
}


def modules_of(package: str) -> list[str]:
    """Every module of ``package`` (subpackages included), by walking its folder."""
    found = [package]
    for info in pkgutil.walk_packages([str(ROOT / package)], prefix=f"{package}."):
        found.append(info.name)
    return sorted(found)


def first_offender(modules: list[str], forbidden: tuple[str, ...]) -> str:
    """Import ``modules`` in order in a fresh interpreter; '' if none loads a
    forbidden package, else the module that first did and what it loaded."""
    code = (
        "import importlib, sys\n"
        f"forbidden = {forbidden!r}\n"
        f"for name in {modules!r}:\n"
        "    importlib.import_module(name)\n"
        "    loaded = [m for m in forbidden if m in sys.modules]\n"
        "    if loaded:\n"
        "        print(name, 'imports', ', '.join(loaded))\n"
        "        break\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip()


@pytest.mark.parametrize("layer", sorted(LAYERS))
def test_every_module_of_a_layer_stays_off_the_heavy_packages(layer):
    packages, forbidden = LAYERS[layer]
    modules = [m for p in packages for m in modules_of(p) if m not in RAY_ADAPTERS]
    assert len(modules) > 5, modules  # the walk found the folder
    assert first_offender(modules, forbidden) == ""


def test_the_exceptions_are_real_ray_adapters():
    """Each named exception exists and imports ray (a stale entry would hide a module)."""
    for name in sorted(RAY_ADAPTERS):
        path = ROOT / (name.replace(".", "/") + ".py")
        assert path.exists(), name
        source = path.read_text()
        assert "import ray" in source or "from ray" in source, f"{name} is no Ray adapter: check it like the rest"


# STYLE.md: "one concept per module, files under ~400 lines"; the tolerance is the "~".
MAX_MODULE_LINES = 420
SIZED_PACKAGES = ("cache", "router", "worker", "deploy", "harness")


def test_every_module_stays_small():
    """A module past the limit holds more than one concept: split it (the
    splits of 2026-12-05 moved code out whole, names re-exported)."""
    sizes = {path.relative_to(ROOT).as_posix(): len(path.read_text().splitlines())
             for package in SIZED_PACKAGES for path in sorted((ROOT / package).rglob("*.py"))}
    assert len(sizes) > 50, sizes  # the walk found the folders
    assert {name: n for name, n in sizes.items() if n > MAX_MODULE_LINES} == {}
