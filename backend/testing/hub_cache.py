"""Put a local checkpoint into a Hugging Face hub cache, as ``snapshot_download`` would have left it.

Tests serve hub ids offline this way (``HF_HOME`` pointing at a temp folder and
``HF_HUB_OFFLINE=1``): ``<hub>/models--org--name/snapshots/<commit>/...`` holds the
files and ``refs/<branch>`` names the commit, which is all the hub client reads when
it cannot go online.
"""
from __future__ import annotations

import hashlib
import shutil
from pathlib import Path


def add_to_hub_cache(hub_cache: Path, repo_id: str, checkpoint: Path, branch: str = "main") -> Path:
    """Copy ``checkpoint`` in as ``repo_id`` at ``branch``; returns the snapshot folder.

    ``hub_cache`` is the hub folder itself (``$HF_HOME/hub``). The commit id is derived
    from the repo id and branch, so each branch gets its own snapshot.
    """
    commit = hashlib.sha1(f"{repo_id}@{branch}".encode()).hexdigest()
    storage = hub_cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = storage / "snapshots" / commit
    shutil.copytree(checkpoint, snapshot, dirs_exist_ok=True)
    (storage / "refs").mkdir(parents=True, exist_ok=True)
    (storage / "refs" / branch).write_text(commit)
    return snapshot
