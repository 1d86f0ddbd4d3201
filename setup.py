"""Builds laminar._laminar with CMake for pyproject.toml (see the comment there for what it needs)."""

import os
import pathlib
import shlex
import shutil
import subprocess
import sys

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext

ROOT = pathlib.Path(__file__).resolve().parent


class CMakeBuild(build_ext):
    def build_extension(self, ext):
        build_dir = pathlib.Path(self.build_temp).resolve() / "cmake"
        prefix = build_dir / "prefix"
        # The library installs into the package directory itself, so the extension's RPATH is $ORIGIN.
        configure = ["cmake", "-S", str(ROOT), "-B", str(build_dir), "-G", "Ninja",
                     "-DCMAKE_BUILD_TYPE=Release", "-DLAMINAR_PYTHON=ON", f"-DPython3_EXECUTABLE={sys.executable}",
                     "-DLAMINAR_BUILD_TESTS=OFF", "-DLAMINAR_BUILD_BENCH=OFF", "-DLAMINAR_BUILD_EXAMPLES=OFF",
                     f"-DCMAKE_INSTALL_PREFIX={prefix}", "-DLAMINAR_PYTHON_INSTALL_DIR=python",
                     "-DCMAKE_INSTALL_LIBDIR=python/laminar"]
        configure += shlex.split(os.environ.get("CMAKE_ARGS", ""))
        subprocess.run(configure, check=True)
        subprocess.run(["cmake", "--build", str(build_dir), "--target", "laminar_python"], check=True)
        subprocess.run(["cmake", "--install", str(build_dir)], check=True)

        out_dir = pathlib.Path(self.get_ext_fullpath(ext.name)).resolve().parent
        out_dir.mkdir(parents=True, exist_ok=True)
        installed = prefix / "python" / "laminar"
        # The extension and the library under its SONAME (the other names are links to it).
        for path in list(installed.glob("_laminar*.so")) + list(installed.glob("liblaminar.so.[0-9]")):
            shutil.copyfile(path, out_dir / path.name)


setup(ext_modules=[Extension("laminar._laminar", sources=[])], cmdclass={"build_ext": CMakeBuild})
