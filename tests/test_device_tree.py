"""scripts/device_tree.sh: slim leaves only the named results/ paths tracked, blocks commits, and restore undoes it all."""
import shutil
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "device_tree.sh"
pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs git")


def git(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["git", "-C", str(repo), *args], capture_output=True, text=True, check=check)


def tree(repo: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(SCRIPT), *args], cwd=repo, capture_output=True, text=True)


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    git(tmp_path, "init", "-q")
    git(tmp_path, "config", "user.email", "t@t")
    git(tmp_path, "config", "user.name", "t")
    for name in ("results/keep/plan.json", "results/big/runs.jsonl", "results/t.json", "src/a.py"):
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(name)
    git(tmp_path, "add", ".")
    git(tmp_path, "commit", "-q", "-m", "init")
    return tmp_path


def test_slim_then_restore(repo: Path) -> None:
    r = tree(repo, "slim", "results/keep", "results/t.json")
    assert r.returncode == 0, r.stderr
    assert sorted(git(repo, "ls-files").stdout.split()) == ["results/keep/plan.json", "results/t.json", "src/a.py"]
    assert git(repo, "ls-files", "--others", "--exclude-standard").stdout == ""  # the rest is ignored, not untracked
    assert (repo / "results/big/runs.jsonl").exists()
    assert git(repo, "commit", "-q", "-m", "x", check=False).returncode != 0  # no commit drops results/
    assert tree(repo, "slim", "results/keep").returncode == 2  # twice is refused
    assert tree(repo, "restore").returncode == 0
    assert git(repo, "status", "--porcelain").stdout == ""
    assert git(repo, "commit", "-q", "--allow-empty", "-m", "y", check=False).returncode == 0


def test_bad_input_changes_nothing(repo: Path) -> None:
    r = tree(repo, "slim", "results/nope")
    assert r.returncode == 2 and "no such path: results/nope" in r.stderr
    assert tree(repo, "slim").returncode == 2
    assert tree(repo).returncode == 2
    assert git(repo, "status", "--porcelain").stdout == ""
    assert len(git(repo, "ls-files").stdout.split()) == 4


def test_restore_when_not_slim_keeps_staged_results(repo: Path) -> None:
    (repo / "results/new.json").write_text("new")
    git(repo, "add", "results/new.json")
    r = tree(repo, "restore")
    assert r.returncode == 2 and "not slim" in r.stderr
    assert git(repo, "diff", "--cached", "--name-only").stdout.split() == ["results/new.json"]
