"""The KServe image's build context, checked without Docker.

The Dockerfile is parsed with Docker's own parser (the ``dockerfile`` package) and the
repository root's ``.dockerignore`` is applied with docker-py's matcher, to every COPY/ADD
source taken from the build context: none may send ``.venv`` or ``.git`` into the image, and
the sources ``pip install`` needs must still get through.
"""
from __future__ import annotations

import fnmatch
import shlex
from pathlib import Path

import pytest

from installed import need
dockerfile = need("dockerfile")
docker_build = need("docker.utils.build")

ROOT = Path(__file__).resolve().parents[1]
DOCKERFILE = ROOT / "client_examples" / "kserve" / "Dockerfile"
DOCKERIGNORE = ROOT / ".dockerignore"

# Representative files of what must stay out; the folders need not exist in this checkout.
FORBIDDEN = (
    ".venv/bin/python",
    ".venv/lib/python3.11/site-packages/torch/lib/libtorch_cpu.so",
    ".git/HEAD",
    ".git/objects/pack/pack-0123.pack",
    "backend/__pycache__/model.cpython-311.pyc",
    "pagedllm.egg-info/PKG-INFO",
)
# What `pip install /opt/pagedllm-src` reads: dropping any of these breaks the image.
REQUIRED = ("pyproject.toml", "README.md", "backend/serving/triton/model.py", "backend/__init__.py", "backend/kernels/__init__.py",
            "model_repository/llm/config.pbtxt")


def ignore_patterns(path: Path) -> list[str]:
    """The patterns of a .dockerignore file, read as Docker reads them (blank lines and # comments skipped)."""
    lines = (line.strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith("#")]


def context_sources(path: Path) -> list[str]:
    """The build-context sources of every COPY/ADD (those copying from another stage are skipped)."""
    sources = []
    for command in dockerfile.parse_file(str(path)):
        if command.cmd.upper() not in ("COPY", "ADD"):
            continue
        if any(flag.startswith("--from") for flag in command.flags):
            continue
        sources += [source for source in command.value[:-1] if "://" not in source]
    return sources


def copied_by(source: str, path: str) -> bool:
    """Whether ``COPY <source>`` would copy context file ``path`` (Docker globs one path segment per ``*``)."""
    parts = [part for part in source.strip("/").split("/") if part not in ("", ".")]
    segments = path.split("/")
    return len(parts) <= len(segments) and all(
        fnmatch.fnmatchcase(segment, part) for segment, part in zip(segments, parts)
    )


def sent(path: str, patterns: list[str], scratch: Path) -> bool:
    """Whether the build context holds ``path`` under these .dockerignore patterns.

    The path is laid out as an empty file under ``scratch`` and the context is walked the way
    Docker walks it (a matching folder is skipped whole), so ``**/`` patterns reach parent folders.
    """
    (scratch / path).parent.mkdir(parents=True, exist_ok=True)
    (scratch / path).touch()
    return path in docker_build.exclude_paths(str(scratch), list(patterns), dockerfile=DOCKERFILE.name)


def test_the_dockerfile_copies_from_the_build_context(tmp_path: Path) -> None:
    sources = context_sources(DOCKERFILE)
    assert sources, "expected COPY steps in the Dockerfile"
    # Without a .dockerignore the copy would take .venv and .git: the checks below are not vacuous.
    for path in (".venv/bin/python", ".git/HEAD"):
        assert any(copied_by(source, path) for source in sources) and sent(path, [], tmp_path)


@pytest.mark.parametrize("path", FORBIDDEN)
def test_no_copy_step_can_pull_in_the_venv_the_git_folder_or_build_junk(path: str, tmp_path: Path) -> None:
    patterns = ignore_patterns(DOCKERIGNORE)
    leaks = [source for source in context_sources(DOCKERFILE)
             if copied_by(source, path) and sent(path, patterns, tmp_path)]
    assert leaks == [], f"COPY {leaks} would send {path} into the image; add it to .dockerignore"


@pytest.mark.parametrize("path", REQUIRED)
def test_the_sources_the_image_installs_still_get_through(path: str, tmp_path: Path) -> None:
    assert (ROOT / path).exists(), f"{path} is gone: update REQUIRED"
    patterns = ignore_patterns(DOCKERIGNORE)
    assert sent(path, patterns, tmp_path), f".dockerignore drops {path}, which the image build needs"
    assert any(copied_by(source, path) for source in context_sources(DOCKERFILE)), f"no COPY step takes {path}"


def test_torch_is_pinned_to_the_base_images_cuda() -> None:
    arguments = {}
    for command in dockerfile.parse_file(str(DOCKERFILE)):
        if command.cmd.upper() == "ARG":
            name, _, value = command.value[0].partition("=")
            arguments[name] = value
    assert arguments.get("TRITON_VERSION") == "24.10", "the README and comments name 24.10 (CUDA 12.6) as the base"
    assert arguments.get("TORCH_INDEX_URL", "").endswith("/cu126"), "24.10 ships CUDA 12.6: use the cu126 torch wheels"
    assert arguments.get("TORCH_VERSION", "").count(".") == 2, "pin an exact torch release"
    installs = [shlex.split(c.value[0]) for c in dockerfile.parse_file(str(DOCKERFILE)) if c.cmd.upper() == "RUN"]
    torch_step = next((words for words in installs if "torch==${TORCH_VERSION}" in words), None)
    assert torch_step is not None and "${TORCH_INDEX_URL}" in torch_step
