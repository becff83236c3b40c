"""The vLLM contracts the connector relies on, checked without an engine (issue 10, finding 1:
on vLLM 0.26 the connector asked for the layout "LBNHC", which only 0.3x knows, and engine
start failed after the model load while preflight's static checks passed)."""

from __future__ import annotations

import pytest

from hsx.engine.connector import HsxHiddenStatesConnector
from hsx.engine.vllm_compat import (
    HIDDEN_STATE_LAYOUT,
    LAYERS_FIRST,
    TOKENS_FIRST,
    connector_contract_problems,
    hidden_state_cache_order,
    known_layout_names,
)
from hsx.preflight.report import Status
from hsx.preflight.run import static_checks
from settings import CaptureSettings, EngineSettings

pytestmark = [pytest.mark.timeout(300)]


class LayoutFromAnotherVllm(HsxHiddenStatesConnector):
    @classmethod
    def get_required_kvcache_layout(cls, vllm_config: object) -> str | None:
        return "LBNHC_NEXT"  # a name some other vLLM release might use


def test_the_connectors_layout_is_known_to_the_installed_vllm() -> None:
    assert HIDDEN_STATE_LAYOUT in known_layout_names()
    assert connector_contract_problems(HsxHiddenStatesConnector) == []


def test_an_unknown_layout_fails_naming_both() -> None:
    problems = connector_contract_problems(LayoutFromAnotherVllm)
    assert len(problems) == 1
    assert "'LBNHC_NEXT'" in problems[0] and "expected one of" in problems[0]
    assert "NHD" in problems[0]  # what this vLLM knows


def test_cache_axis_order_is_read_from_the_backend() -> None:
    assert hidden_state_cache_order(lambda b, n, k, h: (b, n, k, h)) == TOKENS_FIRST  # 0.26
    assert hidden_state_cache_order(lambda b, n, k, h: (b, k, n, h)) == LAYERS_FIRST
    assert hidden_state_cache_order(None) == LAYERS_FIRST  # 0.3x: no shape method
    problems = connector_contract_problems(
        HsxHiddenStatesConnector, shape_fn=lambda b, n, k, h: (b, h, k, n)
    )
    assert len(problems) == 1 and "expected [blocks, block_size, K, H]" in problems[0]
    assert "found (7, 40, 3, 16)" in problems[0]


def test_static_preflight_checks_the_contracts(tiny_llama: object) -> None:
    results, _ = static_checks(tiny_llama, CaptureSettings(), EngineSettings())  # type: ignore[arg-type]
    by_check = {r.check: r for r in results}
    assert by_check["signatures"].status == Status.PASS, by_check["signatures"].summary
    engine = by_check["engine"]
    assert engine.status == Status.PASS and "max_model_len 2048" in engine.summary
    assert any("attention backend" in line for line in engine.details)


def test_a_moved_engine_core_contract_is_named(monkeypatch: pytest.MonkeyPatch) -> None:
    """The installed vLLM has what the engine-core watcher reads; one without it (a release
    that renamed the flag, or whose get_output no longer raises a queued exception) is named."""
    import dataclasses

    from vllm.v1.engine import core_client

    from hsx.engine.vllm_compat import engine_core_watch_problems

    assert engine_core_watch_problems() == []

    @dataclasses.dataclass
    class ResourcesWithoutFlag:
        output_socket: object = None

    class ClientThatPolls:
        def get_output(self) -> object:
            return self.poll()  # type: ignore[attr-defined]

    monkeypatch.setattr(core_client, "BackgroundResources", ResourcesWithoutFlag)
    monkeypatch.setattr(core_client, "SyncMPClient", ClientThatPolls)
    problems = engine_core_watch_problems()
    assert len(problems) == 2, problems
    assert "expected an engine_dead flag" in problems[0] and "output_socket" in problems[0]
    assert "expected it to raise an exception found in outputs_queue" in problems[1]
    assert problems == connector_contract_problems(HsxHiddenStatesConnector)


def test_the_servers_contracts_hold_in_the_installed_vllm_and_a_moved_one_is_named() -> None:
    """`hsx serve` sends each client's channel through a completion's kv_transfer_params and
    reads the connector's reply from the response: both ways checked without a server."""
    from hsx.engine.vllm_compat import serving_contract_problems

    assert serving_contract_problems() == []
    (moved,) = serving_contract_problems(("vllm.entrypoints.nowhere.protocol",))
    assert "expected one of ['vllm.entrypoints.nowhere.protocol'], found none" in moved
    # A release whose request has no kv_transfer_params: named with the fields it has.
    problems = serving_contract_problems(("tests.fixtures.moved_completion_protocol",))
    assert len(problems) == 2 and "CompletionRequest: expected a kv_transfer_params" in problems[0]
    assert "'model'" in problems[0] and "CompletionResponse" in problems[1]


def test_vllm_serve_reads_hsx_flags_back_and_refuses_a_wrong_one(tiny_llama: object) -> None:
    from pathlib import Path

    from hsx.model.config import read_config
    from hsx.serve.server import plan_server, vllm_argument_problems
    from settings import ServeSettings

    settings = ServeSettings(model=Path(str(tiny_llama)), engine={"dtype": "float32"})
    plan = plan_server(settings, read_config(settings.model), (2, 4, 5, 8))
    assert vllm_argument_problems(plan) == []
    assert "--no-enable-prefix-caching" in plan.arguments
    odd = ServeSettings(model=Path(str(tiny_llama)), server={"vllm_args": ["--no-such-flag", "1"]})
    (refused,) = vllm_argument_problems(plan_server(odd, read_config(odd.model), (2, 4, 5, 8)))
    assert "unrecognized arguments: --no-such-flag 1" in refused
