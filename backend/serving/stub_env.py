"""The Python environment the Triton backend stub runs model.py in.

Two facts about the stub shipped in the nvidia-pytriton 0.7.0 wheel decide this file:

* it starts Python isolated (``PYTHONPATH`` is ignored) and takes its prefix from the
  first ``python3`` on ``PATH``, so the stub sees whichever environment ``PATH`` names;
* it was built with a pybind11 that predates NumPy 2: under NumPy 2 it reads a dtype's
  item size from the wrong struct offset and corrupts every BYTES input tensor
  (each string arrives as its first byte repeated). Under NumPy 1.26 it works.

So the server gets its own tiny virtual environment whose ``bin/python3`` comes first
on ``PATH``: its site-packages holds NumPy 1.26 when the launching environment has
NumPy 2, and a ``.pth`` line adds the launching environment's site folders after it
(their ``.pth`` files, editable installs included, take effect too). torch,
transformers and tokenizers run fine on NumPy 1.26.
"""
from __future__ import annotations

import hashlib
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np

NUMPY_FOR_STUB = "numpy>=1.26,<2"
_NUMPY_DIR_ENV = "PAGEDLLM_STUB_NUMPY_DIR"  # a prepared folder holding numpy<2 (offline machines)


def cache_root() -> Path:
    base = os.environ.get("PAGEDLLM_CACHE_DIR") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "pagedllm")
    return Path(base)


def stub_needs_numpy1() -> bool:
    return int(np.__version__.split(".")[0]) >= 2


def running_site_dirs() -> list[str]:
    """The running interpreter's site-packages folders (virtual environment included)."""
    dirs = list(site.getsitepackages())
    if site.ENABLE_USER_SITE and Path(site.getusersitepackages()).is_dir():
        dirs.append(site.getusersitepackages())
    return [d for d in dirs if Path(d).is_dir()]


def stub_env_dir(root: Path | None = None) -> Path:
    """Create (once, atomically) and return the stub's virtual environment for this interpreter."""
    site_dirs = running_site_dirs()
    key = hashlib.sha256("\n".join([sys.prefix, sys.version, *site_dirs]).encode()).hexdigest()[:12]
    major, minor = sys.version_info[:2]
    target = (root or cache_root()) / f"stub-env-py{major}{minor}-{key}"
    if (target / "pyvenv.cfg").exists():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=".stub-env-", dir=target.parent))
    try:
        _build(staging, site_dirs)
        staging.rename(target)
    except OSError:
        if not (target / "pyvenv.cfg").exists():
            raise
    finally:
        shutil.rmtree(staging, ignore_errors=True)
    return target


def _build(env: Path, site_dirs: list[str]) -> None:
    major, minor = sys.version_info[:2]
    site_packages = env / "lib" / f"python{major}.{minor}" / "site-packages"
    site_packages.mkdir(parents=True)
    bin_dir = env / "bin"
    bin_dir.mkdir()
    base_python = Path(getattr(sys, "_base_executable", sys.executable)).resolve()
    for name in ("python", "python3", f"python{major}.{minor}"):
        (bin_dir / name).symlink_to(base_python)
    version = ".".join(map(str, sys.version_info[:3]))
    (env / "pyvenv.cfg").write_text(
        f"home = {base_python.parent}\ninclude-system-site-packages = false\nversion = {version}\n")
    if stub_needs_numpy1():
        _install_numpy1(site_packages)
    # A .pth line that starts with "import" is executed by site.py: this appends the launching
    # environment after our own site-packages, so our NumPy wins and everything else is shared.
    lines = "".join(f"import site; site.addsitedir({d!r})\n" for d in site_dirs)
    (site_packages / "zz_pagedllm_launcher_env.pth").write_text(lines)


def _install_numpy1(site_packages: Path) -> None:
    prepared = os.environ.get(_NUMPY_DIR_ENV)
    if prepared:
        for entry in Path(prepared).iterdir():
            if entry.name.startswith("numpy"):
                link = site_packages / entry.name
                link.symlink_to(entry.resolve(), target_is_directory=entry.is_dir())
        return
    print(f"pagedllm: installing {NUMPY_FOR_STUB} for the Triton backend stub into "
          f"{site_packages.parent.parent.parent} (once; set {_NUMPY_DIR_ENV} to use a prepared folder instead)",
          file=sys.stderr)
    command = [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(site_packages),
               NUMPY_FOR_STUB]
    result = subprocess.run(command, capture_output=True, text=True, check=False)
    if result.returncode != 0:
        raise RuntimeError(
            f"could not install {NUMPY_FOR_STUB} for the Triton backend stub (the stub corrupts string "
            f"tensors under NumPy 2):\n{result.stderr[-2000:]}\nInstall it into a folder yourself with "
            f"`pip install --target DIR '{NUMPY_FOR_STUB}'` and set {_NUMPY_DIR_ENV}=DIR"
        )


if __name__ == "__main__":
    # `python -m pagedllm.serving.stub_env` prepares the environment ahead of the first `pagedllm serve`.
    print(stub_env_dir())
