"""Packagers that carry extra files (the resolved run config) into a Slurm job's directory, and the local-Slurm one
that links the job's code to this working tree.

nemo-run calls the packager when it writes a job's files (code archive, sbatch script), after the experiment
directory exists; the files land in `<job dir>/configs/`, which every rank sees as `/nemo_run/configs/`. Imported
only after NEMORUN_HOME is set (see executors._import_nemo_run).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import nemo_run as run


def _write(job_dir: str, files: dict[str, str]) -> None:
    folder = Path(job_dir) / "configs"
    folder.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        (folder / name).write_text(text)


@dataclass(kw_only=True)
class ShippingGitPackager(run.GitArchivePackager):
    """The repository's committed HEAD as the job's code, plus `files`."""

    files: dict[str, str] = field(default_factory=dict)

    def package(self, path: Path, job_dir: str, name: str) -> str:
        _write(job_dir, self.files)
        return super().package(path, job_dir, name)


@dataclass(kw_only=True)
class ShippingPackager(run.Packager):
    """No code (the container has megatron-rlvr installed), only `files`."""

    files: dict[str, str] = field(default_factory=dict)

    def package(self, path: Path, job_dir: str, name: str) -> str:
        _write(job_dir, self.files)
        return ""


@dataclass(kw_only=True)
class RepoLinkPackager(run.Packager):
    """The job's `code/` (srun's `--chdir`) is a link to `repo`: nodes sharing this filesystem run the working tree
    as it is, its built extension included (an archive of HEAD would have neither it nor uncommitted changes)."""

    repo: str = ""

    def package(self, path: Path, job_dir: str, name: str) -> str:
        link = Path(job_dir) / "code"
        link.parent.mkdir(parents=True, exist_ok=True)
        if not link.is_symlink():
            link.symlink_to(self.repo, target_is_directory=True)
        return ""


def with_shipped_files(packager: run.Packager, files: dict[str, str]) -> run.Packager:
    if isinstance(packager, run.GitArchivePackager):
        return ShippingGitPackager(files=dict(files))
    if type(packager) is run.Packager:
        return ShippingPackager(files=dict(files))
    raise TypeError(f"cannot ship files with packager {type(packager).__name__}")
