"""Which code a benchmark ran: a sha256 over the package's sources and scripts/bench.py (always),
the git commit where there is a checkout, and the way back from such a hash to the commit whose
tree has it (bench_report uses it when a run's git metadata lagged its working tree, as the device
copy's does). Imports no torch."""

from __future__ import annotations

import functools
import hashlib
import subprocess
from pathlib import Path, PurePosixPath
from typing import Iterable, Optional

ROOT = Path(__file__).resolve().parents[1]
BENCH = "scripts/bench.py"


def is_source(path: str) -> bool:
    """The files the hash covers: coda_train's .py and .json files, and bench.py."""
    return path == BENCH or (path.startswith("coda_train/") and path.endswith((".py", ".json")))


def sources_sha256(files: Iterable[tuple[str, bytes]]) -> str:
    """16 hex digits of a sha256 over (path, contents) pairs in path order."""
    digest = hashlib.sha256()
    for path, data in sorted(files, key=lambda f: PurePosixPath(f[0]).parts):
        digest.update(path.encode() + b"\0" + data)
    return digest.hexdigest()[:16]


def _git(*args: str, root: Path = ROOT) -> str:
    return subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=30).stdout.strip()


def code_version(root: Path = ROOT) -> dict:
    """The sources hash of the working tree, the checkout's commit and whether those sources differ
    from it (git_dirty)."""
    paths = [p for p in [*root.glob("coda_train/**/*.py"), *root.glob("coda_train/**/*.json"), root / BENCH]
             if p.is_file()]
    sha = sources_sha256((p.relative_to(root).as_posix(), p.read_bytes()) for p in paths)
    try:
        commit = _git("rev-parse", "HEAD", root=root)
        dirty = bool(commit and _git("status", "--porcelain", "--untracked-files=no", "--", "coda_train", BENCH, root=root))
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return {"git_commit": commit or None, "git_dirty": dirty, "sources_sha256": sha}


def commit_of_sources(sha: str, root: Path = ROOT) -> Optional[str]:
    """The first commit with sources hash `sha` (the oldest of the newest run of HEAD's commits whose tree has it;
    later ones that changed nothing it covers have it too); None where there is none or no git."""
    try:
        head = _git("rev-parse", "HEAD", root=root)
    except (OSError, subprocess.SubprocessError):
        return None
    found = None
    for commit, commit_sha in _sources_of_commits(root, head) if head else ():  # newest first
        if commit_sha == sha:
            found = commit
        elif found:  # past the run of commits with these sources
            break
    return found


@functools.lru_cache(maxsize=None)
def _sources_of_commits(root: Path, head: str) -> tuple[tuple[str, str], ...]:
    """(commit, sources hash) of every commit of one history, newest first (keyed by its head: a new commit is a new
    history), each file version read once: one pass serves every hash a report looks up."""
    try:
        commits = _git("rev-list", head, root=root).split()
        cat = subprocess.Popen(["git", "cat-file", "--batch"], cwd=root, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        blobs: dict[str, bytes] = {}

        def blob(oid: str) -> bytes:  # each distinct file version read once
            if oid not in blobs:
                cat.stdin.write(oid.encode() + b"\n")
                cat.stdin.flush()
                size = int(cat.stdout.readline().split()[2])
                blobs[oid] = cat.stdout.read(size)
                cat.stdout.read(1)  # the newline after the contents
            return blobs[oid]

        shas = []
        try:
            for commit in commits:
                entries = [line.split("\t", 1) for line in _git("ls-tree", "-r", commit, root=root).splitlines()]
                shas.append((commit, sources_sha256((path, blob(meta.split()[2])) for meta, path in entries
                                                    if is_source(path))))
        finally:
            cat.stdin.close()
            cat.wait(timeout=30)
        return tuple(shas)
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return ()
