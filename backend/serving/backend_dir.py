"""Build the folders Triton loads the ``pagedllm`` Python-based backend from.

A Python-based backend is ``<backends>/pagedllm/model.py`` run by the Python backend
in ``<backends>/python/``. The ``model.py`` installed there is a tiny shim that
imports the real model from the installed package: the stub puts the shim's folder
on ``sys.path``, so linking the package folder itself would let modules such as
``pagedllm/logging.py`` shadow the standard library.
"""
from __future__ import annotations

import shutil
import sys
from pathlib import Path

from pagedllm.serving.triton_files import TritonFiles

BACKEND_NAME = "pagedllm"
SHIM_SOURCE = "from pagedllm.serving.triton.model import TritonPythonModel\n"


def assemble_backend_dir(target: Path, files: TritonFiles) -> Path:
    """Create ``target/python`` (the Python backend) and ``target/pagedllm/model.py``; returns ``target``."""
    target = target.resolve()
    python_dir = target / "python"
    python_dir.mkdir(parents=True, exist_ok=True)
    shutil.copy2(files.python_backend_library, python_dir / files.python_backend_library.name)
    shutil.copy2(files.python_backend_utils, python_dir / files.python_backend_utils.name)
    stub = python_dir / "triton_python_backend_stub"
    shutil.copy2(files.python_backend_stub, stub)
    stub.chmod(0o755)
    _write_shim(target / BACKEND_NAME)
    return target


def install_backend(backends_dir: Path) -> Path:
    """Install ``<backends_dir>/pagedllm/model.py`` for a server whose Python backend already exists there.

    This is the NGC ``tritonserver:<yy.mm>-py3`` layout, where ``pagedllm`` is pip-installed
    into the same Python the stub embeds. Returns the written ``model.py``.
    """
    backends_dir = backends_dir.resolve()
    if not backends_dir.is_dir():
        raise ValueError(f"backends_dir {backends_dir} does not exist")
    if not (backends_dir / "python").is_dir():
        print(f"warning: {backends_dir}/python is missing; Triton needs its Python backend there "
              "to run Python-based backends", file=sys.stderr)
    return _write_shim(backends_dir / BACKEND_NAME)


def _write_shim(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.py"
    path.write_text(SHIM_SOURCE)
    return path
