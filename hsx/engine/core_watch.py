"""Waking a thread that waits on vLLM's engine core once that core's process has died.

vLLM's own monitor marks the client dead and shuts it down, but its sync client's get_output()
then waits forever on an output queue nobody fills (seen: a SIGKILLed core hung a run for 10
minutes). The contract this relies on (``resources.engine_dead``, ``outputs_queue``) is checked
by preflight (hsx.engine.vllm_compat.engine_core_watch_problems); an in-process core has neither,
and nothing to watch.
"""

from __future__ import annotations

import logging
import signal
import time
from collections.abc import Callable
from typing import Any

from hsx.errors import EngineError

logger = logging.getLogger(__name__)


def exit_description(process: Any) -> str:
    """'process 123 died of SIGKILL' / 'process 123 exited with 1' / 'process 123 running'."""
    code = getattr(process, "exitcode", None)
    pid = getattr(process, "pid", "?")
    if code is None:
        return f"process {pid} still running"
    if code < 0:
        try:
            return f"process {pid} died of {signal.Signals(-code).name}"
        except ValueError:
            return f"process {pid} died of signal {-code}"
    return f"process {pid} exited with {code}"


def watch_engine_core(llm: Any, watching: Callable[[], bool], period_s: float = 0.2) -> str | None:
    """Block while ``watching()`` and the engine core of ``llm`` (vllm.LLM) lives. When the core
    dies, an EngineError naming how goes into the client's output queue (get_output raises it)
    and its description is returned; None when there is nothing to watch or watching ended."""
    core = getattr(llm.llm_engine, "engine_core", None)
    resources = getattr(core, "resources", None)
    outputs = getattr(core, "outputs_queue", None)
    if resources is None or outputs is None or not hasattr(resources, "engine_dead"):
        return None
    while watching():
        if resources.engine_dead:
            manager = getattr(resources, "engine_manager", None)
            processes = list(getattr(manager, "processes", None) or [])
            death = "engine core " + (
                ", ".join(exit_description(p) for p in processes) or "process died"
            )
            logger.error("vLLM %s", death)
            outputs.put_nowait(EngineError(f"vLLM {death}"))
            return death
        time.sleep(period_s)
    return None
