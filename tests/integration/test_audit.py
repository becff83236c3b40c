"""`hsx audit` on real stores written by the real engine through the in-process Prefect flows:
the tiny Llama (plain, fp32), the tiny DeepSeek-V3 (MLA + MoE, fp8 states) and the tiny Llama's
own greedy regeneration of the bundled conversations. Clean stores pass (their figures are
printed); on the regenerated store every generated position agrees; each defect planted into a
copy (checksums rewritten: `hsx verify` still passes) is named by chunk and sample; a shifted
store fails an extraction's end-of-run audit step; the audit flow publishes its report; the
command reads a store on S3 (moto)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from hsx.audit import AuditReport, audit_store, finding_lines, summary_lines
from hsx.store.verify import verify_store
from hsx.store.zarr_store import ExtractionStore
from hsx.trainers.final_norm import load_final_norm
from tests import audit_defects
from tests.cli import hsx
from tests.conftest import make_settings

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(600)]
SAMPLES = 24
LAYOUT = {"min_work_chunk_tokens": 512, "rows_per_chunk": 64}


@dataclass(frozen=True)
class Made:
    """A store made by the real engine, and how (to extract it again, to audit it)."""

    url: str
    model: Path
    settings: Any
    seconds: float


def _extract(model: Path, dataset: Path, url: str, **sections: dict[str, Any]) -> Made:
    from flows.extract import extract_flow

    settings = make_settings(
        model,
        dataset,
        url,
        data={"max_samples": SAMPLES},
        layout=LAYOUT,
        run={"preflight": False},
        **sections,
    )
    started = time.perf_counter()
    summary = extract_flow(settings)
    assert summary["verified"] and summary["audit"].startswith("ok"), summary
    return Made(url, model, settings, time.perf_counter() - started)


@pytest.fixture(scope="module")
def regenerated(
    prefect_harness: None,
    tiny_llama: Path,
    sample_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Made:
    """The tiny Llama's greedy regeneration of 24 conversations (12 tokens a turn) through the
    real `hsx regenerate` (a process of its own: a generation engine is not built in a process
    that built an extraction engine), extracted in this one."""
    root = tmp_path_factory.mktemp("audit-regenerated")
    out = root / "regenerated"
    done = hsx(
        "regenerate", "--model", str(tiny_llama), "--dataset", str(sample_dataset),
        "--out", str(out), "--max-samples", str(SAMPLES), "--max-tokens", "12",
        "--conversations-per-chunk", "8", "--sampling", '{"temperature": 0}',
        "--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25",
    )  # fmt: skip
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return _extract(tiny_llama, out, str(root / "regenerated.zarr"))


@pytest.fixture(scope="module")
def llama(
    prefect_harness: None,
    tiny_llama: Path,
    sample_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Made:
    url = str(tmp_path_factory.mktemp("audit-llama") / "llama.zarr")
    return _extract(tiny_llama, sample_dataset, url)


@pytest.fixture(scope="module")
def deepseek(
    prefect_harness: None,
    tiny_deepseek: Path,
    sample_dataset: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Made:
    url = str(tmp_path_factory.mktemp("audit-deepseek") / "deepseek-fp8.zarr")
    return _extract(tiny_deepseek, sample_dataset, url, capture={"store_dtype": "fp8_e4m3"})


def _show(title: str, report: AuditReport) -> None:  # seen with pytest -s
    print(f"\n== {title}")
    print("\n".join(summary_lines(report) + finding_lines(report)))


def test_a_greedy_regenerated_store_agrees_on_every_generated_position(regenerated: Made) -> None:
    report = audit_store(regenerated.url, regenerated.model)
    _show("tiny Llama, its own greedy regeneration", report)
    check = report.greedy_check
    assert report.greedy["exact"], report.greedy
    assert (
        check.positions > 300
        and check.disagree == 0
        and check.agree + check.ties == check.positions
    )
    assert report.masked.top1 + check.ties == report.masked.positions
    assert report.alignment.startswith("aligned: shift 0 predicts best")
    assert report.ok


def test_clean_stores_pass_and_their_run_records_keep_the_end_of_run_audit(
    llama: Made, deepseek: Made
) -> None:
    from typer.testing import CliRunner

    from flows.cli import app

    for title, made in (("tiny Llama, fp32", llama), ("tiny DeepSeek-V3, fp8", deepseek)):
        report = audit_store(made.url, made.model)
        _show(f"{title} (extraction {made.seconds:.1f} s)", report)
        assert report.ok and report.rows_read == report.data.tokens > 1000
        assert report.masked.positions > 500 and report.other.positions > 500
        assert report.head is not None and report.head["tensor"].endswith("lm_head.weight")
        assert not report.greedy["exact"]  # the bundled conversations: not the model's own
        assert all(layer.nan == layer.zero == layer.repeated == 0 for layer in report.layers)
        (record,) = ExtractionStore.open(made.url).run_records()
        assert record["summary"]["audit"].startswith("ok: "), record["summary"]
        info = CliRunner().invoke(app, ["info", made.url])
        assert info.exit_code == 0 and "audit ok: " in info.output, info.output
    fp8 = audit_store(deepseek.url, deepseek.model)
    assert all(layer.scale_min and layer.scale_max for layer in fp8.layers)
    runs = CliRunner().invoke(app, ["runs", "--json", "--limit", "50"])
    audits = [row["audit"] for row in json.loads(runs.output) if row["store"] == llama.url]
    assert audits and audits[0].startswith("ok: "), runs.output


# defect -> (the store it goes into, the finding's kind, what its message must say)
DEFECTS = {
    "shifted": (
        "regenerated",
        "shifted",
        r"states are shifted by -1 \(the state at row t predicts token t,",
    ),
    "swapped": ("regenerated", "greedy-disagreement", r"sample \d+ holds the states of sample \d+"),
    "post-norm": ("regenerated", "post-norm", r"looks post-norm: RMS of state / norm weight is 1"),
    "wrong-order": (
        "regenerated",
        "greedy-disagreement",
        r"Layer slot 0 predicts them .*wrong order",
    ),
    "rows-short": (
        "regenerated",
        "rows-short",
        r"states cover \d+ of its \d+ tokens .*last 5 rows",
    ),
    "zero-vectors": ("deepseek", "zero-vectors", r"layer id 4: (\d+) of \1 all-zero vectors"),
    "nan-vectors": ("deepseek", "nan-vectors", r"layer id 2: 1 of \d+ NaN vectors .*position 3"),
}


def _plant(defect: str, url: str, model: Path) -> audit_defects.Planted:
    if defect == "post-norm":
        norm = load_final_norm(model)
        return audit_defects.apply_final_norm(url, norm.weight.numpy(), norm.eps)
    return {
        "shifted": audit_defects.shift_states,
        "swapped": audit_defects.swap_samples,
        "wrong-order": audit_defects.reverse_layers,
        "rows-short": audit_defects.cut_rows,
        "zero-vectors": audit_defects.zero_layer,
        "nan-vectors": audit_defects.nan_vector,
    }[defect](url)


@pytest.mark.parametrize("defect", list(DEFECTS))
def test_each_planted_defect_is_named_by_chunk_and_sample(
    defect: str, regenerated: Made, deepseek: Made, tmp_path: Path
) -> None:
    where, kind, message = DEFECTS[defect]
    made = regenerated if where == "regenerated" else deepseek
    url = audit_defects.copy_store(made.url, tmp_path / "planted.zarr")
    planted = _plant(defect, url, made.model)
    assert verify_store(ExtractionStore.open(url)).ok  # the bytes check out
    report = audit_store(url, made.model)
    found = [f for f in report.errors if f.kind == kind and re.search(message, f.message)]
    print(f"\n== {defect} planted in chunk {planted.chunk}, samples {list(planted.samples)}:")
    print("\n".join(f"[{f.severity}] {f.message}" for f in report.errors))
    assert found, [f.message for f in report.findings]
    assert found[0].chunks == [planted.chunk] and f"chunk {planted.chunk}" in found[0].message
    assert set(found[0].samples) & set(planted.samples), (found[0].samples, planted)
    assert not {c for f in report.errors for c in f.chunks} - {planted.chunk}


def test_states_shifted_fail_the_extractions_audit_step(regenerated: Made, tmp_path: Path) -> None:
    """A re-run over a store whose states are shifted (its chunks committed, checksums right):
    nothing to extract, verify passes, the end-of-run audit fails the run naming the chunk."""
    from flows.extract import extract_flow

    url = audit_defects.copy_store(regenerated.url, tmp_path / "shifted.zarr")
    planted = audit_defects.shift_states(url)
    settings = regenerated.settings.model_copy(update={"store": url})
    state = extract_flow(settings, return_state=True)
    assert state.is_failed()
    error = str(state.result(raise_on_failure=False))
    assert "end-of-run audit of" in error and "expected states aligned with their tokens" in error
    assert f"chunk {planted.chunk}: states are shifted by -1" in error, error
    records = [r for r in ExtractionStore.open(url).run_records() if r["status"] == "failed"]
    assert [r["failed_in"] for r in records] == ["audit"], records


def test_the_audit_flow_publishes_its_report_and_fails_on_errors(
    deepseek: Made, tmp_path: Path
) -> None:
    from prefect.client.orchestration import get_client
    from prefect.client.schemas.filters import ArtifactFilter, ArtifactFilterFlowRunId

    from flows.audit import StoreAuditFailedError, audit_flow

    url = audit_defects.copy_store(deepseek.url, tmp_path / "nan.zarr")
    audit_defects.nan_vector(url)
    out = tmp_path / "report"
    state = audit_flow(url, str(deepseek.model), out=str(out), return_state=True)
    assert state.is_failed()
    error = state.result(raise_on_failure=False)
    assert isinstance(error, StoreAuditFailedError) and error.report is not None
    assert "NaN vectors" in str(error)
    assert {p.name for p in out.iterdir()} == {
        "report.json", "report.md", "agreement.png", "norms.png", "lengths.png", "coverage.png",
    }  # fmt: skip
    assert not json.loads((out / "report.json").read_text())["ok"]
    with get_client(sync_client=True) as client:
        artifacts = client.read_artifacts(
            artifact_filter=ArtifactFilter(
                flow_run_id=ArtifactFilterFlowRunId(any_=[state.state_details.flow_run_id])
            )
        )
    by_key = {a.key: a for a in artifacts}
    assert {"hsx-audit", "hsx-audit-chunks", "hsx-run-summary"} <= set(by_key)
    assert str(by_key["hsx-audit"].data).count("data:image/png;base64,") == 4


def test_the_audit_command_reads_a_store_on_s3(
    llama: Made, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The command itself (its Typer app, in this process: the session's Prefect API) on a
    store on S3 (moto), its report as JSON; bad input refused with exit 2 before any work."""
    import fsspec
    from typer.testing import CliRunner

    from flows.cli import app
    from tests.servers import moto_s3, s3_config

    with moto_s3(tmp_path / "moto.log") as port:
        config = s3_config(f"http://127.0.0.1:{port}")
        monkeypatch.setitem(fsspec.config.conf, "s3", config)
        s3 = fsspec.filesystem("s3", skip_instance_cache=True)
        s3.mkdir("audit")
        s3.put(llama.url, "audit/llama.zarr", recursive=True)
        done = CliRunner().invoke(
            app, ["audit", "s3://audit/llama.zarr", "--model", str(llama.model), "--json"]
        )
        other = CliRunner().invoke(
            app,
            [
                "audit",
                "s3://audit/llama.zarr",
                "--model",
                str(llama.model.with_name("tiny-deepseek-v3")),
            ],
        )
    assert done.exit_code == 0, done.output[-3000:]
    report = json.loads(done.stdout[done.stdout.index("{") :])
    local = audit_store(llama.url, llama.model)
    assert report["ok"] and report["store"] == "s3://audit/llama.zarr"
    assert report["masked"] == {
        "positions": local.masked.positions,
        "top1": local.masked.top1,
        "top5": local.masked.top5,
        "log_prob": pytest.approx(local.masked.log_prob),
    }
    assert other.exit_code == 2
    assert re.search(
        r"error: audit: expected the model the store was extracted with \(config digest \w+\), found \w+",
        other.output,
    ), other.output
