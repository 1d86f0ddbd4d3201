"""`cmake --install` gives a package that imports from outside the source and build trees, finding
liblaminar through its RPATH, and says its version."""

import os
import pathlib
import re
import subprocess
import sys

import pytest

import laminar

SCRIPT = """
import laminar
q = laminar.TrajectoryQueue()
q.push(laminar.Trajectory(id=3, response_tokens=[1, 2], logprobs=[-0.5, -0.5], rewards=[1.0]))
print(laminar.__file__, q.pop_batch(laminar.BatchSpec(max_trajectories=1)).ids.tolist(), laminar.__version__)
"""


def test_installed_package_imports(tmp_path):
    build = os.environ.get("LAMINAR_BUILD_DIR")
    if not build:
        pytest.skip("CTest names the build tree to install (LAMINAR_BUILD_DIR)")
    python_dir = pathlib.PurePath(os.environ["LAMINAR_PYTHON_INSTALL_DIR"])
    if python_dir.is_absolute():
        pytest.skip(f"this build installs into the virtual environment at {python_dir}")
    prefix = tmp_path / "prefix"
    subprocess.run([os.environ["LAMINAR_CMAKE"], "--install", build, "--prefix", str(prefix)], check=True,
                   stdout=subprocess.DEVNULL)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "LD_LIBRARY_PATH")}
    env["PYTHONPATH"] = str(prefix / python_dir)
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    path, ids, version = run.stdout.split()
    assert pathlib.Path(path).is_relative_to(prefix)
    assert ids == "[3]" and version == laminar.__version__


def test_version_is_the_projects():
    """CMake's project version (the extension's) and pyproject.toml's, which pip uses, agree."""
    pyproject = (pathlib.Path(__file__).resolve().parents[2] / "pyproject.toml").read_text()
    assert laminar.__version__ == re.search(r'^version = "([^"]+)"', pyproject, re.M).group(1)
