"""Where the `nvidia-pytriton` wheel keeps its tritonserver, libraries and Python backend.

The wheel is used only as a carrier of the server binary: ``pytriton`` itself is
never imported (its dependency pins are not installed), so its location is found
through the import system without executing it.
"""
from __future__ import annotations

import importlib.util
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

_WHEEL_HINT = "pip install --no-deps nvidia-pytriton==0.7.0"


@dataclass(frozen=True, slots=True)
class TritonFiles:
    """Absolute paths of everything needed to run the wheel's tritonserver with a Python backend."""

    server_binary: Path
    library_dir: Path  # the wheel's vendored shared libraries (libtritonserver, libcudart, ...)
    python_backend_library: Path  # libtriton_python.so
    python_backend_utils: Path  # triton_python_backend_utils.py
    python_backend_stub: Path  # the stub built for the running interpreter's X.Y

    @property
    def all_paths(self) -> tuple[Path, ...]:
        return (self.server_binary, self.library_dir, self.python_backend_library,
                self.python_backend_utils, self.python_backend_stub)


def find_triton_files(python_version: tuple[int, int] | None = None) -> TritonFiles:
    """Locate the pytriton wheel's files; raises ``FileNotFoundError`` saying how to install it."""
    spec = importlib.util.find_spec("pytriton")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the nvidia-pytriton wheel is not installed; install it with `{_WHEEL_HINT}`")
    package_dir = Path(next(iter(spec.submodule_search_locations))).resolve()
    server_dir = package_dir / "tritonserver"
    major, minor = python_version or sys.version_info[:2]
    files = TritonFiles(
        server_binary=server_dir / "bin" / "tritonserver",
        library_dir=package_dir.parent / "nvidia_pytriton.libs",
        python_backend_library=server_dir / "backends" / "python" / "libtriton_python.so",
        python_backend_utils=server_dir / "backends" / "python" / "triton_python_backend_utils.py",
        python_backend_stub=server_dir / "python_backend_stubs" / f"{major}.{minor}" / "triton_python_backend_stub",
    )
    missing = [str(path) for path in files.all_paths if not path.exists()]
    if missing:
        raise FileNotFoundError(
            f"the nvidia-pytriton wheel at {package_dir} lacks {missing} "
            f"(Python {major}.{minor} needs a matching backend stub); reinstall it with `{_WHEEL_HINT}`"
        )
    return files


def interpreter_library_dir() -> Path | None:
    """The folder holding the running interpreter's ``libpython`` shared library, if it has one.

    The backend stub links ``libpython3.X.so.1.0`` by soname; putting this folder first on
    ``LD_LIBRARY_PATH`` makes the stub embed the same Python build (and standard library)
    as the interpreter that launched the server, rather than whatever the system provides.
    """
    soname = sysconfig.get_config_var("INSTSONAME")
    if not soname:
        return None
    # LIBDIR is a build-time path; relocatable builds (uv, conda) keep the library under the prefix.
    folders = [sysconfig.get_config_var("LIBDIR"), str(Path(sys.base_prefix) / "lib")]
    for folder in filter(None, folders):
        if (Path(folder) / soname).exists():
            return Path(folder)
    return None
