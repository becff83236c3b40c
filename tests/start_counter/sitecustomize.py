"""Counts the expensive starts of a test run across every process it spawns (imported at start-up
by each Python process whose PYTHONPATH holds this folder; tests/starts.py puts it there and
prints the totals). Only where ``TESTS_START_LOG`` names a file: one JSON line per event.

- ``process``: a Python process began, with its argv (`hsx serve`, `prefect server start`,
  flow-run processes are told apart from it);
- ``engine``: a vLLM engine core was built (vllm.v1.engine.core.EngineCore.__init__, in-process
  or in its own process, `vllm serve`'s included), with its seconds.

Counting only: nothing here changes what a process does."""

from __future__ import annotations

import os

_LOG = os.environ.get("TESTS_START_LOG")


def _record(kind: str, **fields: object) -> None:
    import json
    import time

    line = json.dumps({"kind": kind, "pid": os.getpid(), "t": time.time(), **fields})
    try:
        with open(_LOG or os.devnull, "a") as out:  # one short append: atomic between processes
            out.write(line + "\n")
    except OSError:
        pass


def _install() -> None:
    import importlib.abc
    import importlib.machinery
    import sys
    import time

    _record("process", argv=list(sys.orig_argv))

    class _WrapEngineCore(importlib.abc.MetaPathFinder):
        """After vllm.v1.engine.core is imported, time EngineCore.__init__ in it."""

        def find_spec(self, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "vllm.v1.engine.core":
                return None
            spec = importlib.machinery.PathFinder.find_spec(name, path)
            if spec is None or spec.loader is None:
                return spec
            loader = spec.loader
            original_exec = loader.exec_module  # type: ignore[attr-defined]

            def exec_module(module):  # type: ignore[no-untyped-def]
                original_exec(module)
                core = module.EngineCore
                init = core.__init__

                def timed_init(self, *args, **kwargs):  # type: ignore[no-untyped-def]
                    started = time.monotonic()
                    try:
                        init(self, *args, **kwargs)
                    finally:
                        _record("engine", seconds=round(time.monotonic() - started, 2))

                core.__init__ = timed_init

            loader.exec_module = exec_module  # type: ignore[attr-defined]
            return spec

    sys.meta_path.insert(0, _WrapEngineCore())


if _LOG:
    _install()
