"""What the machine offers the engine: the CPU's AMX, Linux's per-process AMX permission, and
names for the signals an engine process can die of.

Linux hands out AMX tile state per process, on request (``arch_prctl(ARCH_REQ_XCOMP_PERM)``);
an AMX instruction run before anyone asked faults with SIGILL, and the process dies without a
Python traceback. vLLM's CPU kernels use AMX on CPUs that have it, and whether torch asked first
depends on which thread initialised what (measured: an engine built in a fresh thread of a fresh
process died with SIGILL, exit 132; ``torch.cpu._init_amx()`` first made it pass). So hsx asks
before any engine is built, in every process that builds one.
"""

from __future__ import annotations

import faulthandler
import functools
import logging
import signal
import sys
from pathlib import Path

logger = logging.getLogger(__name__)

AMX_FLAGS = ("amx_tile", "amx_bf16", "amx_int8")


@functools.lru_cache(maxsize=1)
def cpu_flags() -> frozenset[str]:
    """The CPU's feature flags from /proc/cpuinfo (empty where there is none)."""
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return frozenset()
    for line in text.splitlines():
        if line.startswith("flags"):
            return frozenset(line.partition(":")[2].split())
    return frozenset()


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX tiles (vLLM's CPU build then picks its AMX kernels)."""
    return "amx_tile" in cpu_flags()


@functools.cache
def request_amx() -> bool:
    """Ask Linux for AMX tile state for this process, once; True when granted.

    Idempotent and cheap; a no-op (False) on CPUs without AMX. Call it before building an
    engine, in the process that builds it (the permission is per process, for all its threads:
    the answer cannot change while the process lives, so it is cached)."""
    granted = False
    if cpu_has_amx():
        import torch

        init = getattr(torch.cpu, "_init_amx", None)
        if init is None:
            logger.warning(
                "this CPU has AMX but torch %s has no torch.cpu._init_amx: AMX not requested",
                torch.__version__,
            )
        else:
            granted = bool(init())
            if not granted:
                logger.warning("this CPU has AMX but Linux refused the AMX permission request")
    return granted


def enable_fault_reports() -> None:
    """A fatal signal (SIGSEGV, SIGILL, SIGBUS, SIGFPE, SIGABRT) prints the Python traceback of
    every thread to stderr before the process dies, instead of a bare shell message."""
    if not faulthandler.is_enabled():
        faulthandler.enable(file=sys.stderr, all_threads=True)


def exit_description(returncode: int | None) -> str:
    """How a child process ended, in words: 'exit code 2', 'killed by SIGILL (illegal
    instruction)'. Handles both Popen's negative codes and a shell's 128+N."""
    if returncode is None:
        return "still running"
    number = -returncode if returncode < 0 else returncode - 128 if 128 < returncode < 160 else 0
    if number:
        try:
            sig = signal.Signals(number)
        except ValueError:
            return f"exit code {returncode}"
        meaning = signal.strsignal(sig) or sig.name
        return f"killed by {sig.name} ({meaning.lower()})"
    return f"exit code {returncode}"


def cpu_thread_binding(tensor_parallel_size: int) -> str | None:
    """vLLM's CPU build binds each TP rank's threads to a NUMA node and refuses more ranks than
    nodes ("Not enough allowed NUMA nodes to bind threads of 2 local CPUWorkers"): split this
    process's CPUs evenly between the ranks instead, as ``VLLM_CPU_OMP_THREADS_BIND`` wants
    them ("0-7|8-15"). None for one rank, or when there are fewer CPUs than ranks."""
    import os

    cpus = sorted(os.sched_getaffinity(0))
    if tensor_parallel_size <= 1 or len(cpus) < tensor_parallel_size:
        return None
    per_rank = len(cpus) // tensor_parallel_size
    groups = [cpus[i * per_rank : (i + 1) * per_rank] for i in range(tensor_parallel_size)]
    return "|".join(",".join(str(c) for c in group) for group in groups)


_PR_SET_PDEATHSIG = 1


def die_with_parent(signum: int = signal.SIGKILL) -> None:
    """Popen's ``preexec_fn`` (in the child, between fork and exec): the kernel sends the child
    ``signum`` when its parent dies, whatever kills the parent (an OOM kill leaves no orphan
    behind). SIGTERM for a child that stops what it started itself on SIGTERM (`hsx serve`,
    vLLM's server: a SIGKILL would orphan their engine core)."""
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signum)
