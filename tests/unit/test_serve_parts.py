"""`hsx serve`'s parts that need no engine: its settings (one environment with extraction), the
channel a request may name, the identity a run checks, vLLM's flags, systemd's readiness
message, the batch of a completion request, and the systemd units and their example files."""

from __future__ import annotations

import configparser
import os
import socket
from concurrent.futures import Future
from pathlib import Path

import numpy as np
import pytest
import torch
from pydantic import ValidationError

from hsx.engine.server_client import _Batch
from hsx.engine.server_protocol import (
    CHANNEL_PREFIX,
    ChannelRequest,
    identity_problems,
    prompt_digest,
    shm_folder,
)
from hsx.serve.server import notify_systemd, server_flags
from settings import HsxSettings, ServeSettings

pytestmark = pytest.mark.timeout(120)
ROOT = Path(__file__).resolve().parents[2]


def _env_file(path: Path) -> dict[str, str]:
    pairs = {}
    for line in path.read_text().splitlines():
        if line.strip() and not line.startswith("#"):
            key, _, value = line.partition("=")
            pairs[key] = value
    return pairs


def test_serve_settings_come_from_the_environment_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    """A systemd unit's environment file configures the server; extraction variables beside it
    are passed over, and extraction's settings pass over the server's."""
    env = _env_file(ROOT / "infra" / "systemd" / "serve.env.example")
    for key, value in {**env, "HSX_SERVER__PORT": "8107", "HSX_DATA__MAX_SAMPLES": "5"}.items():
        monkeypatch.setenv(key, value)
    settings = ServeSettings()
    assert settings.model == Path("/models/Kimi-K2-Instruct")
    assert settings.server.port == 8107 and settings.engine.tensor_parallel_size == 8
    # The same environment builds extraction settings: HSX_SERVER__* is not refused there.
    extraction = HsxSettings(dataset=Path("d.jsonl"), store="s.zarr")
    assert extraction.engine.tensor_parallel_size == 8 and extraction.data.max_samples == 5


def test_serve_settings_refuse_what_would_make_the_server_lie(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    with pytest.raises(ValidationError, match=r"expected no engine.url, found \['http://a:1'\]"):
        ServeSettings(model=Path("m"), engine={"url": ["http://a:1"]})
    with pytest.raises(ValidationError, match=r"found \['--enable-prefix-caching'\]"):
        ServeSettings(model=Path("m"), server={"vllm_args": ["--enable-prefix-caching"]})
    assert ServeSettings(
        model=Path("m"), server={"vllm_args": ["--gpu-memory-utilization", "0.45"]}
    ).server.vllm_args == ["--gpu-memory-utilization", "0.45"]
    monkeypatch.setenv("HSX_SERVER__PROT", "8100")
    with pytest.raises(ValidationError, match=r"did you mean server\.port"):
        ServeSettings(model=Path("m"))


def test_a_server_beyond_loopback_needs_a_key_and_keys_stay_out_of_every_dump(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    for host in ("0.0.0.0", "10.1.2.3", "gpu-node-7"):
        with pytest.raises(ValidationError, match=f"server.host '{host}' listens beyond this"):
            ServeSettings(model=Path("m"), server={"host": host})
    forced = ServeSettings(
        model=Path("m"), server={"host": "0.0.0.0", "allow_remote_without_key": True}
    )
    assert forced.server.api_key is None
    for host in ("127.0.0.1", "127.0.0.2", "::1", "localhost"):
        assert ServeSettings(model=Path("m"), server={"host": host}).server.host == host
    monkeypatch.setenv("HSX_SERVER__API_KEY", "s3cret-server")
    monkeypatch.setenv("HSX_ENGINE__API_KEY", "s3cret-client")
    served = ServeSettings(model=Path("m"), server={"host": "0.0.0.0"})
    assert served.server.api_key is not None
    assert served.server.api_key.get_secret_value() == "s3cret-server"
    client = HsxSettings(model=Path("m"), dataset=Path("d.jsonl"), store="s.zarr")
    assert client.engine.api_key is not None
    # Prefect's parameters, run records and /hsx/info are dumps: the keys are in none of them.
    dumps = served.model_dump_json() + client.model_dump_json() + repr(served) + repr(client)
    assert "s3cret" not in dumps
    with pytest.raises(ValidationError, match=r"found \['--api-key'\]"):
        ServeSettings(model=Path("m"), server={"vllm_args": ["--api-key", "x"]})


def test_a_request_names_only_a_channel_folder_of_a_client() -> None:
    """The server writes into the folder a request names: only hsx channel folders in shared
    memory (or the temporary folder) are taken, never another path."""
    good = f"{shm_folder()}/{CHANNEL_PREFIX}abc"
    secret = "0" * 64
    params = {"channel": good, "granules": 4, "key": "k", "secret": secret}
    assert ChannelRequest.from_params(params).channel == good
    for bad in (
        "/etc",
        f"{shm_folder()}/other-abc",
        f"{shm_folder()}/{CHANNEL_PREFIX}x/../../etc",
        f"relative/{CHANNEL_PREFIX}x",
    ):
        with pytest.raises(ValueError, match="expected a folder hsx-channel-"):
            ChannelRequest.from_params({**params, "channel": bad})
    with pytest.raises(
        ValueError, match=r"expected \['channel', 'granules', 'key', 'secret'\], fo"
    ):
        ChannelRequest.from_params({"key": "k"})


def test_identity_problems_name_both_values(tmp_path: Path) -> None:
    marker = tmp_path / "marker"
    marker.touch()
    served = {
        "model_config_hash": "a",
        "weights_fingerprint": "w",
        "layer_ids": [2, 4, 5, 8],
        "engine_dtype": "float32",
        "max_model_len": 2048,
        "shm_marker": str(marker),
    }
    expected = {**served, "layer_ids": [1, 3, 8], "max_model_len": 4096}
    problems = identity_problems(served, expected, "http://s:1")
    assert problems == [
        "layer ids (vLLM numbering): the run expects [1, 3, 8], server http://s:1 serves "
        "[2, 4, 5, 8]",
        "max_model_len: the run needs 4096 (its longest sample + 1), server http://s:1 takes 2048",
    ]
    marker.unlink()  # the server's marker is not in this node's shared memory
    (problem,) = identity_problems(served, served, "http://s:1")
    assert f"marker {marker} there, found none" in problem


def test_engine_arguments_become_vllm_flags() -> None:
    flags = server_flags(
        {
            "model": "skipped",
            "enable_prefix_caching": False,
            "enforce_eager": True,
            "max_model_len": 2048,
            "speculative_config": {"method": "extract_hidden_states"},
            "seed": None,
        }
    )
    assert flags == [
        "--no-enable-prefix-caching",
        "--enforce-eager",
        "--max-model-len",
        "2048",
        "--speculative-config",
        '{"method":"extract_hidden_states"}',
    ]


@pytest.mark.parametrize("abstract", [False, True], ids=["path", "abstract"])
def test_systemd_hears_ready_through_its_notify_socket(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, abstract: bool
) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert notify_systemd("READY=1") is False  # outside systemd: nothing to tell
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as listener:
        if abstract:
            name = f"hsx-test-{os.getpid()}"
            listener.bind("\0" + name)
            monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
        else:
            listener.bind(str(tmp_path / "notify"))
            monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "notify"))
        listener.settimeout(5)
        assert notify_systemd("READY=1\nSTATUS=serving") is True
        assert listener.recv(4096) == b"READY=1\nSTATUS=serving"


def test_a_batch_sends_identical_prompts_once_and_answers_each() -> None:
    batch = _Batch("b")
    prompts = [np.arange(5, dtype=np.int32), np.arange(3, dtype=np.int32), np.arange(5)]
    futures: list[Future[torch.Tensor]] = [Future() for _ in prompts]
    for prompt, future in zip(prompts, futures, strict=True):
        batch.add(prompt, future)
    assert list(batch.prompts) == [prompt_digest(prompts[0]), prompt_digest(prompts[1])]
    assert batch.tokens == 8  # sent once each: 5 + 3
    rows = torch.ones(5, 2, 4)
    batch.fan_out(prompt_digest(prompts[0])).set_result(rows)
    assert futures[0].result() is rows and futures[2].result() is rows
    assert not futures[1].done()
    singles = batch.split()  # a refused batch is sent again prompt by prompt
    assert [len(s.prompts) for s in singles] == [1, 1]
    assert singles[1].futures[prompt_digest(prompts[1])] == [futures[1]]


def test_the_systemd_units_run_hsx_serve_and_its_worker() -> None:
    unit = configparser.ConfigParser(strict=False, interpolation=None)
    unit.read(ROOT / "infra" / "systemd" / "hsx-serve@.service")
    service = unit["Service"]
    assert service["Type"] == "notify" and service["ExecStart"].endswith("hsx serve")
    assert "HSX_SERVER__PORT=%i" in service["Environment"]
    assert "NCCL_NVLS_ENABLE=0" in service["Environment"]
    assert service["EnvironmentFile"] == "/etc/hsx/serve-%i.env"
    worker = configparser.ConfigParser(strict=False, interpolation=None)
    worker.read(ROOT / "infra" / "systemd" / "hsx-worker.service")
    assert "infra/start-worker.sh" in worker["Service"]["ExecStart"]
    assert "hsx-serve@" in worker["Unit"]["After"]


def test_a_server_that_never_answers_fails_the_chunk_after_server_wait_s() -> None:
    """engine.url naming a port nobody listens on: acquire fails after engine.server_wait_s,
    naming the setting and the last error, instead of waiting forever."""
    import time

    from hsx.engine.server_pool import ServerPool
    from hsx.errors import EngineError

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"  # closed once the block ends
    pool = ServerPool([url], {}, 256, 1 << 20, 1.5)
    started = time.monotonic()
    with pytest.raises(EngineError, match=r"within 1\.5 s \(engine\.server_wait_s\), found none"):
        pool.acquire()
    assert 1.5 <= time.monotonic() - started < 15
    pool.close()
