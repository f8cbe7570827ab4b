"""Where the project's shared public traces lie: ../shared beside the main checkout, or beside the folder of a
worktree (wt/NAME); tests that need a file skip when neither holds it."""
from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRACES = next((d / "data" / "traces" for d in (REPO.parent / "shared", REPO.parents[1] / "shared") if d.is_dir()),
              REPO.parent / "shared" / "data" / "traces")
