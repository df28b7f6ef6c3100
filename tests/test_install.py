"""Packaging: ``passes/`` at the repo root is the subpackage ``replay_backend.passes``,
in the editable install and in a normal wheel install alike."""
from __future__ import annotations

import importlib
import importlib.util
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent


def test_passes_is_a_subpackage_of_the_repo():
    mod = importlib.import_module("replay_backend.passes")
    assert mod.__name__ == "replay_backend.passes"
    assert Path(mod.__file__).resolve() == (REPO_ROOT / "passes" / "__init__.py").resolve()
    import replay_backend

    assert Path(replay_backend.__file__).resolve().parent == (REPO_ROOT / "replay_backend").resolve()


def _need_pip_wheel():
    if importlib.util.find_spec("pip") is None:
        pytest.skip("pip is not installed in this interpreter, cannot run `pip wheel`")
    if importlib.util.find_spec("setuptools") is None:
        pytest.skip("setuptools (the build backend) is not installed; `pip wheel "
                    "--no-build-isolation` cannot build without it")
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--help"], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"`pip wheel` is unavailable: {r.stderr.strip()[:200]}")


@pytest.fixture(scope="module")
def wheel(tmp_path_factory):
    """Build a wheel of a copy of the repo (so the build leaves nothing in the work tree)."""
    _need_pip_wheel()
    tmp = tmp_path_factory.mktemp("wheel")
    src = tmp / "src"
    shutil.copytree(REPO_ROOT, src, ignore=shutil.ignore_patterns(
        ".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache", ".hypothesis",
        "tests", "out", ".whl"))
    out = tmp / "out"
    r = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"pip wheel failed:\n{r.stdout[-3000:]}\n{r.stderr[-3000:]}"
    wheels = list(out.glob("dsv41_replay-*.whl"))
    assert len(wheels) == 1, list(out.iterdir())
    return wheels[0]


def test_wheel_maps_passes_into_the_package(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    assert "replay_backend/passes/__init__.py" in names
    assert not [n for n in names if n.startswith("passes/")], "a top-level passes/ package leaked into the wheel"
    # every package of the source tree, passes/ as replay_backend/passes
    root = Path(__file__).parents[1]
    for init in root.joinpath("replay_backend").rglob("__init__.py"):
        assert init.relative_to(root).as_posix() in names, f"{init.parent.name} is not in the wheel"
    assert not [n for n in names if n.startswith("tests/")]
    ep = [n for n in names if n.endswith(".dist-info/entry_points.txt")]
    assert len(ep) == 1
    text = zipfile.ZipFile(wheel).read(ep[0]).decode()
    assert "replay-backend = replay_backend.reference.cli:main" in text
    assert "[torch_dynamo_backends]" in text


def test_wheel_install_imports_passes(wheel, tmp_path):
    target = tmp_path / "site"
    r = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(target), str(wheel)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (target / "replay_backend" / "passes" / "__init__.py").is_file()
    assert not (target / "passes").exists()
    # import every module from the installed copy alone: the editable install's finder,
    # which would find a package the wheel lacks in the repository, is taken out first
    env = dict(os.environ, PYTHONPATH=str(target))
    code = ("import sys, pkgutil, importlib\n"
            "sys.meta_path[:] = [f for f in sys.meta_path if 'editable' not in repr(f).lower()]\n"
            "import replay_backend.passes as p, replay_backend as r\n"
            "for m in pkgutil.walk_packages(r.__path__, 'replay_backend.'):\n"
            "    if not m.name.endswith('pytest_plugin'):\n"
            "        assert importlib.import_module(m.name).__file__.startswith(sys.argv[1]), m.name\n"
            "print(p.__file__); print(r.__file__)")
    r = subprocess.run([sys.executable, "-c", code, str(target.resolve())], capture_output=True, text=True, env=env,
                       cwd=tmp_path, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    pfile, rfile = r.stdout.split()
    assert Path(pfile).resolve() == (target / "replay_backend" / "passes" / "__init__.py").resolve()
    assert Path(rfile).resolve() == (target / "replay_backend" / "__init__.py").resolve()


def test_public_surface():
    """``replay_backend.counters`` is the counters object with ``expect``."""
    import replay_backend

    assert hasattr(replay_backend.counters, "expect")
    with replay_backend.counters.expect(trims=0, recompiles=0):
        pass
    for name in ("ReplayBackend", "ReplayConfig", "StepRunner", "plan_of", "replay_begin", "replay_end"):
        assert hasattr(replay_backend, name), name


def test_the_core_imports_no_model():
    """The backend, its passes, dispatch, capture and inspection load without the reference model;
    its names load on first use."""
    code = ("import sys, replay_backend, replay_backend.backend, replay_backend.dispatch.trim_op, replay_backend.capture.graphs, "
            "replay_backend.passes.row_local, replay_backend.inspection, replay_backend.pytest_plugin\n"
            "loaded = sorted(m for m in sys.modules if m.startswith('replay_backend.reference'))\n"
            "assert not loaded, loaded\n"
            "assert replay_backend.preset('tiny').num_layers == 40 and replay_backend.StepRunner\n"
            "assert 'replay_backend.reference' in sys.modules\n")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
