"""The wheels the GPU check carries to the device machine: does each locked file install under its python?

The device image runs python 3.12 on x86-64 Linux (glibc 2.39) with no registry in reach, so whatever the check
needs beyond the image (tools/gpu_check/image_packages.txt) travels as wheels in ``.whl/`` (git-ignored, filled by
tools/gpu_wheels.sh from tools/gpu_check/wheels.lock). Checked here, on any machine:

- every locked file name carries a tag that python 3.12 on that machine accepts, one version per project (two would
  stop ``pip install --no-index`` there);
- with ``.whl/`` present: exactly the locked files, each with its locked sha256, each holding a package to import,
  and each one's run-time needs (Requires-Dist without extras) on the image or in the lock.

    python tools/gpu_check/wheels.py                  # .whl/ must be there
    python tools/gpu_check/wheels.py --allow-missing  # a clean clone (CI): the lock's tags only
"""

from __future__ import annotations

import argparse
import hashlib
import re
import sys
import zipfile
from dataclasses import dataclass
from email.parser import Parser
from pathlib import Path

from packaging import tags
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name, parse_wheel_filename

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
LOCK = HERE / "wheels.lock"
IMAGE_PACKAGES = HERE / "image_packages.txt"
DEVICE_PYTHON = (3, 12)
DEVICE_GLIBC_MINOR = 39  # python 3.12.3 on the image: Ubuntu 24.04's glibc 2.39


class WheelError(Exception):
    """A carried wheel would not install or import on the device machine."""


@dataclass(frozen=True)
class Locked:
    requirement: str
    file: str
    sha256: str

    @property
    def project(self) -> str:
        return canonicalize_name(Requirement(self.requirement).name)


def read_lock(path: Path = LOCK) -> list[Locked]:
    entries = []
    for n, line in enumerate(path.read_text().splitlines(), 1):
        line = line.split("#", 1)[0].strip()
        if not line:
            continue
        parts = line.split()
        if len(parts) != 3 or not re.fullmatch(r"[0-9a-f]{64}", parts[2]):
            raise WheelError(f"{path}:{n}: expected 'requirement file sha256', got {line!r}")
        entries.append(Locked(*parts))
    return entries


def image_packages(path: Path = IMAGE_PACKAGES) -> set[str]:
    lines = (line.split("#", 1)[0].strip() for line in path.read_text().splitlines())
    return {canonicalize_name(line) for line in lines if line}


def device_tags() -> set[tags.Tag]:
    """Every tag pip on the device's python accepts (CPython 3.12, manylinux up to its glibc, x86-64)."""
    platforms = [f"manylinux_2_{m}_x86_64" for m in range(DEVICE_GLIBC_MINOR, 4, -1)]
    platforms += ["manylinux2014_x86_64", "manylinux2010_x86_64", "manylinux1_x86_64", "linux_x86_64"]
    abi = f"cp{DEVICE_PYTHON[0]}{DEVICE_PYTHON[1]}"
    found = set(tags.cpython_tags(DEVICE_PYTHON, abis=[abi, "abi3", "none"], platforms=platforms))
    return found | set(tags.compatible_tags(DEVICE_PYTHON, abi, platforms))


def check_tags(files: list[str]) -> list[str]:
    """Problems with these wheel file names for the device (empty: every one installs there)."""
    accepted, problems, versions = device_tags(), [], {}
    for name in files:
        try:
            project, version, _, file_tags = parse_wheel_filename(name)
        except Exception as exc:  # packaging's InvalidWheelFilename and friends
            problems.append(f"{name}: not a wheel file name ({exc})")
            continue
        if not file_tags & accepted:
            problems.append(
                f"{name}: none of its tags ({', '.join(sorted(map(str, file_tags)))}) installs on "
                f"CPython {DEVICE_PYTHON[0]}.{DEVICE_PYTHON[1]} x86-64 Linux"
            )
        versions.setdefault(project, set()).add(str(version))
    problems += [
        f"{p}: {len(v)} versions ({', '.join(sorted(v))}); pip --no-index needs one"
        for p, v in versions.items()
        if len(v) > 1
    ]
    return problems


def _runtime_needs(metadata: str) -> list[Requirement]:
    """Requires-Dist entries that apply on the device without any extra."""
    env = default_environment() | {
        "python_version": "3.12",
        "python_full_version": "3.12.3",
        "sys_platform": "linux",
        "platform_machine": "x86_64",
        "implementation_name": "cpython",
        "extra": "",
    }
    needs = []
    for line in Parser().parsestr(metadata).get_all("Requires-Dist") or []:
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate(env):
            needs.append(req)
    return needs


def check_dir(whl_dir: Path, lock: list[Locked]) -> list[str]:
    """Problems with the wheels in ``whl_dir`` against the lock (empty: they are what the device needs)."""
    problems = []
    present = sorted(p.name for p in whl_dir.glob("*.whl"))
    extra = sorted(set(present) - {e.file for e in lock})
    if extra:
        problems.append(f"{whl_dir}: wheels not in {LOCK.name}: {extra} (rerun tools/gpu_wheels.sh)")
    available = image_packages() | {e.project for e in lock}
    for entry in lock:
        path = whl_dir / entry.file
        if not path.is_file():
            problems.append(f"{path}: missing (run tools/gpu_wheels.sh)")
            continue
        digest = hashlib.sha256(path.read_bytes()).hexdigest()
        if digest != entry.sha256:
            problems.append(f"{path}: sha256 {digest} but {LOCK.name} says {entry.sha256}")
        with zipfile.ZipFile(path) as z:
            names = z.namelist()
            meta = next((n for n in names if n.endswith(".dist-info/METADATA")), None)
            if meta is None:
                problems.append(f"{path}: no .dist-info/METADATA")
                continue
            if not any(n.endswith("/__init__.py") or (n.endswith(".py") and "/" not in n) for n in names):
                problems.append(f"{path}: holds no python package to import")
            for req in _runtime_needs(z.read(meta).decode()):
                if canonicalize_name(req.name) not in available:
                    problems.append(
                        f"{entry.file}: needs {req} at run time, which is neither on the device image "
                        f"({IMAGE_PACKAGES.name}) nor in {LOCK.name}"
                    )
    return problems


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dir", type=Path, default=REPO / ".whl", help="the carried wheels (default: .whl/)")
    parser.add_argument(
        "--allow-missing",
        action="store_true",
        help="a missing wheel folder is not an error (a clean clone): check the lock's tags only",
    )
    args = parser.parse_args(argv)
    lock = read_lock()
    problems = check_tags([e.file for e in lock])
    if args.dir.is_dir():
        problems += check_dir(args.dir, lock)
        where = f"{args.dir} ({sum(p.stat().st_size for p in args.dir.glob('*.whl')) / 2**20:.1f} MiB)"
    elif args.allow_missing:
        where = f"lock only: {args.dir} is absent, presence not checked (tools/gpu_wheels.sh fills it)"
    else:
        problems.append(f"{args.dir}: absent; run tools/gpu_wheels.sh here (PyPI in reach) before the GPU call")
        where = str(args.dir)
    for p in problems:
        print(f"wheels: {p}", file=sys.stderr)
    if problems:
        return 1
    print(f"wheels: ok, {len(lock)} locked for CPython {DEVICE_PYTHON[0]}.{DEVICE_PYTHON[1]} x86-64; {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
