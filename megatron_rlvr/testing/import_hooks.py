"""Patch a module right after its first import, from a `sitecustomize` hook on PYTHONPATH: how the long-tail workload
(testing/long_tail) changes a prompt's sampling parameters and slows each of vLLM's engine steps inside the processes
torchrun and Slurm start. Its engine steps run inside vLLM's ``LLM.generate`` loop, where the run has no event of its
own (runtime/callbacks.py has the events a test or benchmark acts on otherwise)."""

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
