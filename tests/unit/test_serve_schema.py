"""What a request may put in ``kv_transfer_params`` (hsx.engine.server_protocol's one schema),
how values a request sent reach a log line (hsx.engine.log_safety), and which vLLM flags
``server.vllm_args`` may not set, however spelled (settings, then vLLM's own parser).

``hostile_transfer_params`` is the generated corpus the served fuzz test
(tests/integration/test_serve_hostile.py) sends through a real `hsx serve` too."""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from hsx.engine.channel_files import KEY_PATTERN
from hsx.engine.log_safety import shown
from hsx.engine.server_protocol import (
    CHANNEL_PREFIX,
    MAX_GRANULES,
    ChannelRequest,
    RequestParamsError,
    TransferParams,
    shm_folder,
)
from settings import ServeSettings
from settings.serve import RESERVED_VLLM_FLAGS, reserved_flag

pytestmark = pytest.mark.timeout(120)

GOOD_SECRET = "ab" * 32
KV_CONFIG = '{"kv_connector": "X", "kv_role": "kv_both"}'


def good_params(channel: str | None = None, secret: str = GOOD_SECRET) -> dict[str, Any]:
    """kv_transfer_params.hsx as hsx's client sends it."""
    folder = channel or f"{shm_folder()}/{CHANNEL_PREFIX}abc_123"
    return {"channel": folder, "granules": 4, "key": "0a1b2c:ffee", "secret": secret}


# Values of every JSON type and of the edges of each: what a request may send in any field.
EDGE_VALUES: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    1.0,
    4.5,
    -0.0,
    math.inf,
    -math.inf,
    math.nan,
    1e308,
    2**31,
    2**63,
    2**64 + 1,
    10**300,
    MAX_GRANULES + 1,
    "",
    "4",
    " 4",
    "\x00",
    "a\nb",
    "\r\n[fake] log line",
    "\x1b[31mred\x1b[0m",
    "\u202egnp.exe",
    "\u2028",
    "\ud800",
    "é" * 300,
    "🦙" * 50,
    "k" * (1 << 20),
    [],
    [4],
    {},
    {"granules": 4},
    [[[[[]]]]],
]


def hostile_transfer_params(seed: int, count: int, channel: str, secret: str) -> Iterator[Any]:
    """``count`` kv_transfer_params the schema must refuse, generated from ``seed``: each a
    valid request (naming ``channel`` with ``secret``) with one field, or the whole, replaced by
    an edge value, a wrong type, an unknown key, a nested or oversized structure."""
    rng = random.Random(seed)
    fields = ["channel", "granules", "key", "secret"]
    for _ in range(count):
        base = good_params(channel, secret)
        move = rng.randrange(8)
        if move <= 3:  # one field of hsx replaced
            name = rng.choice(fields)
            value = rng.choice(EDGE_VALUES)
            if name == "granules" and type(value) is int and 0 < value <= MAX_GRANULES:
                value = -value
            if name == "key" and isinstance(value, str) and KEY_PATTERN.fullmatch(value):
                value = "." + value  # "4" is a good key: a key may not start with "."
            base[name] = value
            yield {"hsx": base}
        elif move == 4:  # one field missing, or one more
            if rng.random() < 0.5:
                del base[rng.choice(fields)]
            else:
                base[rng.choice(["do_remote_prefill", "Channel", "secret ", "\x00"])] = 1
            yield {"hsx": base}
        elif move == 5:  # the channel path bent: outside, up, doubled, a control character
            base["channel"] = rng.choice(
                [
                    "/etc",
                    f"{shm_folder()}/{CHANNEL_PREFIX}x/../../etc",
                    f"{shm_folder()}//{CHANNEL_PREFIX}x",
                    f"relative/{CHANNEL_PREFIX}x",
                    f"{shm_folder()}/{CHANNEL_PREFIX}x\x00",
                    f"{shm_folder()}/{CHANNEL_PREFIX}x\n",
                    f"{shm_folder()}/{CHANNEL_PREFIX}" + "y" * 5000,
                    f"/proc/self/{CHANNEL_PREFIX}x",
                ]
            )
            yield {"hsx": base}
        elif move == 6:  # the whole of kv_transfer_params, or of hsx, of another type
            value = rng.choice([v for v in EDGE_VALUES if v not in ({}, None)])
            yield value if rng.random() < 0.5 else {"hsx": value}
        else:  # the encoding field, or an unknown top-level key
            if rng.random() < 0.5:
                yield {"hsx": base, "hsx_state_encoding": rng.choice(EDGE_VALUES[1:])}
            else:
                yield {"hsx": base, rng.choice(["do_remote_prefill", "hsx2", ""]): True}


def test_the_clients_own_parameters_pass_and_round_trip() -> None:
    request = ChannelRequest.from_params(good_params())
    assert TransferParams.of(request.to_params()).hsx == request
    assert TransferParams.of(None).hsx is None  # a plain completion
    assert TransferParams.of({"hsx_state_encoding": "fp8_e4m3"}).hsx_state_encoding == "fp8_e4m3"


def test_the_fp8_encoding_is_the_stores() -> None:
    from hsx.engine.server_protocol import FP8_ENCODING
    from hsx.store.fp8_states import ENCODING

    assert FP8_ENCODING == ENCODING


@pytest.mark.parametrize(
    ("params", "message"),
    [
        # The attacks, each refused naming its field, what was expected and found.
        (
            {"hsx": {**good_params(), "granules": math.inf}},
            r"kv_transfer_params\.hsx\.granules: expected a valid integer, found inf",
        ),
        (
            {"hsx": {**good_params(), "channel": f"{shm_folder()}/{CHANNEL_PREFIX}x\x00"}},
            r"kv_transfer_params\.hsx\.channel: expected a folder hsx-channel-\* .*found "
            r"'/dev/shm/hsx-channel-x\\x00'",
        ),
        (
            {"hsx": {**good_params(), "channel": f"{shm_folder()}/{CHANNEL_PREFIX}x\nFORGED"}},
            r"found '/dev/shm/hsx-channel-x\\nFORGED'",
        ),
        (
            {"hsx": {**good_params(), "granules": MAX_GRANULES + 1}},
            r"granules: expected 1\.\.16777216, found 16777217",
        ),
        ({"hsx": {**good_params(), "granules": True}}, r"granules: expected a valid integer"),
        ({"hsx": {**good_params(), "granules": "4"}}, r"granules: expected a valid integer"),
        (
            {"hsx": {**good_params(), "key": "k" * (1 << 20)}},
            r"hsx\.key: expected letters.*found 'k{120}'\.\.\. \(1048576 characters\)$",
        ),
        (
            {"hsx": {k: v for k, v in good_params().items() if k != "secret"}},
            r"kv_transfer_params\.hsx: expected \['channel', 'granules', 'key', 'secret'\], "
            r"found \['channel', 'granules', 'key'\] \(no secret\)",
        ),
        ({"hsx": {**good_params(), "secret": "x"}}, r"hsx\.secret: expected the 64 hex digits"),
        ({"hsx": good_params(), "do_remote_prefill": True}, r"expected only \['hsx', 'hsx_sta"),
        ("a string", r"kv_transfer_params: expected an object, found 'a string'"),
        ([1, 2], r"kv_transfer_params: expected an object, found \[1, 2\]"),
        ({"hsx_state_encoding": "fp4"}, r"hsx_state_encoding: expected 'fp8_e4m3' or none"),
    ],
)
def test_a_hostile_value_is_refused_naming_its_field(params: Any, message: str) -> None:
    with pytest.raises(RequestParamsError, match=message) as refused:
        TransferParams.of(params)
    assert len(str(refused.value)) < 1000


def test_a_generated_corpus_is_refused_every_time_with_a_safe_message() -> None:
    """Types, bounds, unicode and sizes in every field: each refused with RequestParamsError
    (never another exception), its message one line of bounded length."""
    corpus = list(
        hostile_transfer_params(7, 2000, f"{shm_folder()}/{CHANNEL_PREFIX}abc", "ab" * 32)
    )
    for params in corpus:
        with pytest.raises(RequestParamsError) as refused:
            TransferParams.of(params)
        said = str(refused.value)
        assert said.startswith("kv_transfer_params"), said
        assert len(said) < 1500, said[:200]
        assert said.isprintable(), said  # no newline, NUL, escape or bidi character raw


def test_a_secret_is_never_shown() -> None:
    near = "ab" * 31 + "a"  # 63 characters: one short of a real secret
    with pytest.raises(RequestParamsError) as refused:
        ChannelRequest.from_params(good_params(secret=near))
    assert near not in str(refused.value) and "found 63 characters" in str(refused.value)


def test_shown_escapes_what_could_forge_or_flood_a_log_line() -> None:
    assert shown("a\nb") == "'a\\nb'"
    assert shown("x\x00\x1b[31m\u202e") == "'x\\x00\\x1b[31m\\u202e'"
    long = shown("k" * (1 << 20))
    assert long == "'" + "k" * 120 + "'... (1048576 characters)"
    assert shown(b"\xff" * 500).endswith("... (500 bytes)")
    nested = shown({"a\n": ["b\r"] * 10_000, "c": 10**300})
    assert "\n" not in nested and "\r" not in nested and len(nested) < 600
    assert shown(math.inf) == "inf"


@pytest.mark.parametrize(
    ("arguments", "flag"),
    [
        (["--hos", "192.0.2.1"], "--host"),
        (["--ho", "0.0.0.0"], "--host"),
        (["--api-ke", "k"], "--api-key"),
        (["--api_key=k"], "--api-key"),
        (["--kv-transfer-config.kv_connector", "x"], "--kv-transfer-config"),
        (["--enable_prefix_caching"], "--enable-prefix-caching"),
        (["--config", "more-flags.yaml"], "--config"),
        (["--middlew", "evil.Middleware"], "--middleware"),
    ],
)
def test_reserved_flags_are_refused_however_spelled(arguments: list[str], flag: str) -> None:
    assert reserved_flag(arguments[0]) == flag
    with pytest.raises(ValueError, match="expected flags hsx does not set itself") as refused:
        ServeSettings(model=Path("m"), server={"vllm_args": arguments})
    said = refused.value.errors()[0]["msg"]  # type: ignore[attr-defined]
    assert "=k" not in said  # the flag as written, never its value


def test_other_flags_pass() -> None:
    extra = ["--gpu-memory-utilization", "0.45", "--enforce-eager", "--max-num-seqs=8", "-O3"]
    assert ServeSettings(model=Path("m"), server={"vllm_args": extra}).server.vllm_args == extra


@pytest.mark.vllm
def test_vllms_own_parser_finds_what_the_spelling_rules_miss() -> None:
    """vLLM's `vllm serve` parser reads server.vllm_args as its server will: short flags,
    abbreviations, a positional model; and no flag of vLLM's is a prefix of a reserved one
    (the settings' abbreviation rule refuses only what argparse would complete to one)."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    from hsx.serve.server import reserved_flag_problems

    parser = FlexibleArgumentParser(prog="vllm")
    subparsers = parser.add_subparsers(dest="subparser")
    ServeSubcommand().subparser_init(subparsers)
    serve = subparsers.choices["serve"]
    for extra, flag in [
        (["-tp", "2"], "--tensor-parallel-size"),
        (["--hos", "192.0.2.1"], "--host"),
        (["--api_key", "k"], "--api-key"),
        (["--kv-transfer-config", KV_CONFIG], "--kv-transfer-config"),
        (["--middleware", "evil.Middleware"], "--middleware"),
        (["--seed", "0"], "--seed"),  # the default value: still hsx's to set
        (["/other/model"], "MODEL_TAG (positional)"),
    ]:
        (problem,) = reserved_flag_problems(serve, extra)
        assert f"found them setting ['{flag}']" in problem, (extra, problem)
    (dotted,) = reserved_flag_problems(serve, ["--kv-transfer-config.kv_connector", "X"])
    assert "--kv-transfer-config" in dotted  # refused, by vLLM's parser or as hsx's
    assert reserved_flag_problems(serve, ["--gpu-memory-utilization", "0.45"]) == []
    (refused,) = reserved_flag_problems(serve, ["--no-such-flag"])
    assert "vllm serve refuses them" in refused
    options = {o for action in serve._actions for o in action.option_strings}
    assert options | {"--no-enable-prefix-caching"} >= RESERVED_VLLM_FLAGS
    prefixes = sorted(
        o
        for o in options - RESERVED_VLLM_FLAGS
        if o.startswith("--") and any(r.startswith(o) for r in RESERVED_VLLM_FLAGS)
    )
    assert prefixes == [], prefixes
