"""Patch a module right after its first import, from a `sitecustomize` hook on PYTHONPATH: how the test and benchmark
hooks (testing/long_tail, tests/launch/slow_checkpoint, tests/launch/stalled_eval) change one function of the
training path inside the processes torchrun and Slurm start, with no line of that path knowing."""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys
from collections.abc import Callable
from types import ModuleType


class _PatchAfterImport(importlib.abc.MetaPathFinder):
    def __init__(self, name: str, patch: Callable[[ModuleType], None]) -> None:
        self.name, self.patch = name, patch

    def find_spec(self, name, path, target=None):
        if name != self.name:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module, patch = spec.loader.exec_module, self.patch

        def exec_and_patch(module: ModuleType) -> None:
            exec_module(module)
            patch(module)

        spec.loader.exec_module = exec_and_patch
        return spec


def patch_after_import(name: str, patch: Callable[[ModuleType], None]) -> None:
    """Call ``patch(module)`` once module ``name`` has been executed, before anyone else sees it."""
    sys.meta_path.insert(0, _PatchAfterImport(name, patch))
