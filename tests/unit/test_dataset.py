"""hsx.data.tokenization: JSONL validation errors, chat-template loss masks, truncation, fingerprints."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import xxhash

from hsx.data.tiny_models import train_tokenizer
from hsx.data.tokenization import (
    _loss_mask,
    fingerprint_file,
    fingerprint_tokenizer,
    iter_conversations,
    tokenize_conversation,
    tokenize_conversations,
    validate_dataset,
)
from hsx.errors import DatasetError

pytestmark = pytest.mark.timeout(120)

SAMPLE_DATA = Path(__file__).resolve().parents[2] / "data" / "sample_conversations.jsonl"
END = "<|im_end|>"


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    target = tmp_path_factory.mktemp("tiny-tokenizer")
    train_tokenizer(target)
    return target


@pytest.fixture(scope="session")
def tokenizer(tokenizer_dir: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


@pytest.fixture
def fresh_tokenizer(tokenizer_dir: Path) -> Any:
    """A private copy, for tests that change the chat template."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tokenizer_dir))


def write_lines(path: Path, lines: list[str]) -> Path:
    path.write_text("".join(line + "\n" for line in lines), encoding="utf-8")
    return path


def chat(*turns: tuple[str, str]) -> list[dict[str, str]]:
    return [{"role": role, "content": content} for role, content in turns]


GOOD = json.dumps({"messages": chat(("user", "hi"), ("assistant", "hello"))})


# --- reading and validation ------------------------------------------------------------------


@pytest.mark.parametrize(
    ("bad_line", "found"),
    [
        ('{"messages": [', "not JSON"),
        ("[1, 2]", "found list"),
        ('"just a string"', "found str"),
        ('{"id": "x"}', "found no messages or conversations or conversation key"),
        ('{"messages": "hi"}', "'hi'"),
        ('{"messages": []}', "found []"),
        ('{"messages": ["hi"]}', "found str 'hi'"),
        ('{"messages": [{"role": 1, "content": "x"}]}', "expected a role in"),
        ('{"messages": [{"role": "user"}]}', "found NoneType None"),
        ('{"messages": [{"role": "assistant", "content": ["x"]}]}', "text parts only"),
        ('{"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}', "image_url"),
        ('{"messages": [{"role": "bot", "content": "x"}]}', "'bot'"),
        ('{"messages": [{"role": "user", "content": "x"}]}', "['user']"),
        ('{"id": [7], "messages": [{"role": "assistant", "content": "x"}]}', "found list [7]"),
        ('{"id": "hsx:3", "messages": [{"role": "assistant", "content": "x"}]}', "'hsx:'"),
        ('{"conversations": [{"from": "bot", "value": "x"}]}', "ShareGPT 'from'"),
    ],
)
def test_bad_line_names_file_line_and_found(tmp_path: Path, bad_line: str, found: str) -> None:
    path = write_lines(tmp_path / "data.jsonl", [GOOD, "", bad_line, GOOD])
    with pytest.raises(DatasetError) as caught:
        validate_dataset(path)
    message = str(caught.value)
    assert f"{path}:3" in message
    assert "expected" in message
    assert found in message


def test_invalid_utf8_names_line(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    path.write_bytes(GOOD.encode() + b"\n" + b'{"messages": "\xff\xfe"}\n')
    with pytest.raises(DatasetError, match=rf"{path}:2: expected a JSON object"):
        validate_dataset(path)


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "absent.jsonl"
    with pytest.raises(
        DatasetError, match=rf"{path}: expected a dataset file or folder, found nothing"
    ):
        validate_dataset(path)


def test_directory_is_not_a_dataset(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match=r"expected a save_to_disk folder .* found \[\]"):
        validate_dataset(tmp_path)


@pytest.mark.parametrize("content", ["", "\n\n  \n"])
def test_empty_file(tmp_path: Path, content: str) -> None:
    path = tmp_path / "empty.jsonl"
    path.write_text(content)
    with pytest.raises(DatasetError, match=rf"{path}: expected at least one conversation"):
        validate_dataset(path)


def test_first_error_wins(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.jsonl", [GOOD, "oops", '{"messages": 1}'])
    with pytest.raises(DatasetError, match=rf"{path}:2:"):
        validate_dataset(path)


def test_streaming_yields_good_lines_before_the_bad_one(tmp_path: Path) -> None:
    path = write_lines(tmp_path / "data.jsonl", [GOOD, GOOD, "oops"])
    seen = iter_conversations(path)
    assert next(seen).line_number == 1
    assert next(seen).line_number == 2
    with pytest.raises(DatasetError, match=":3:"):
        next(seen)


def test_blank_lines_skipped_and_indices(tmp_path: Path) -> None:
    with_id = json.dumps({"id": "abc", "messages": chat(("user", "q"), ("assistant", "a"))})
    path = write_lines(tmp_path / "data.jsonl", ["", GOOD, "   ", with_id, ""])
    conversations = list(iter_conversations(path))
    assert [(c.index, c.line_number, c.sample_id) for c in conversations] == [
        (0, 2, "hsx:0"),
        (1, 4, "abc"),
    ]
    assert conversations[1].messages == tuple(chat(("user", "q"), ("assistant", "a")))
    assert conversations[1].as_chat() == chat(("user", "q"), ("assistant", "a"))
    assert validate_dataset(path) == 2


def test_bundled_sample_dataset_validates() -> None:
    assert validate_dataset(SAMPLE_DATA) == 300
    first = next(iter_conversations(SAMPLE_DATA))
    assert first.sample_id == "sample-0-000000"


# --- tokenization and loss masks -------------------------------------------------------------


def masked_segments(tokenizer: Any, sample: Any) -> list[str]:
    """Decode each contiguous run of masked tokens."""
    segments: list[str] = []
    run: list[int] = []
    for token, flag in zip(sample.input_ids.tolist(), sample.loss_mask.tolist(), strict=True):
        if flag:
            run.append(token)
        elif run:
            segments.append(tokenizer.decode(run, skip_special_tokens=False))
            run = []
    if run:
        segments.append(tokenizer.decode(run, skip_special_tokens=False))
    return segments


def template_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(tokenizer.apply_chat_template(messages, tokenize=True)["input_ids"])


def assert_mask(tokenizer: Any, messages: list[dict[str, str]], end: str = END) -> None:
    sample = tokenize_conversation(tokenizer, messages, max_length=4096)
    assert sample.input_ids.dtype == np.int32
    assert sample.loss_mask.dtype == np.uint8
    assert sample.input_ids.shape == sample.loss_mask.shape == (sample.num_tokens,)
    assert not sample.truncated
    assert sample.input_ids.tolist() == template_ids(tokenizer, messages)
    expected = [m["content"] + end for m in messages if m["role"] == "assistant"]
    assert masked_segments(tokenizer, sample) == expected


def test_single_turn_mask(tokenizer: Any) -> None:
    assert_mask(tokenizer, chat(("user", "Tell me about bees."), ("assistant", "Bees make honey.")))


def test_multi_turn_with_system_mask(tokenizer: Any) -> None:
    messages = chat(
        ("system", "You are a concise, friendly assistant."),
        ("user", "Why do people find tea interesting?"),
        ("assistant", "Tea leaves are withered, rolled, oxidised to taste, and dried."),
        ("user", "Thanks. Can you say that more simply?"),
        ("assistant", "In short, it is simpler than it first looks."),
        ("tool", "42"),
        ("assistant", "The answer is 42."),
    )
    assert_mask(tokenizer, messages)


def test_mask_only_covers_assistant_tokens(tokenizer: Any) -> None:
    messages = chat(("system", "Be brief."), ("user", "Hi"), ("assistant", "Hello there."))
    sample = tokenize_conversation(tokenizer, messages, max_length=4096)
    unmasked = tokenizer.decode(sample.input_ids[sample.loss_mask == 0].tolist())
    assert "Hello" not in unmasked
    assert "Be brief." in unmasked and "Hi" in unmasked
    assert unmasked.endswith("\n")  # the newline after <|im_end|> belongs to the template


def test_every_bundled_conversation_masks_its_assistant_turns(tokenizer: Any) -> None:
    for conversation in iter_conversations(SAMPLE_DATA):
        assert_mask(tokenizer, conversation.as_chat())


@pytest.mark.parametrize(
    "turns",
    [
        [("user", "ok"), ("assistant", "ok")],
        [("user", "ok"), ("assistant", "ok"), ("user", "ok"), ("assistant", "ok")],
        [("system", "yes"), ("user", "say yes"), ("assistant", "yes")],
        # Answers that also occur inside the role headers the template writes.
        [("user", "a"), ("assistant", "a")],
        [("user", "who are you?"), ("assistant", "assistant")],
        [("user", "who am I?"), ("assistant", "user")],
        [("user", "x"), ("assistant", "")],
    ],
)
def test_repeated_or_ambiguous_content_gets_its_own_span(
    tokenizer: Any, turns: list[tuple[str, str]]
) -> None:
    assert_mask(tokenizer, chat(*turns))


def test_tuple_and_dict_messages_agree(tokenizer: Any) -> None:
    turns = (("user", "hi"), ("assistant", "hello"))
    from_tuples = tokenize_conversation(tokenizer, turns, max_length=64)
    from_dicts = tokenize_conversation(tokenizer, chat(*turns), max_length=64)
    assert np.array_equal(from_tuples.input_ids, from_dicts.input_ids)
    assert np.array_equal(from_tuples.loss_mask, from_dicts.loss_mask)


LLAMA3_LIKE = (
    "{{ bos_token }}{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n\n{{ message['content'] | trim }}<|im_end|>"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n\n{% endif %}"
)
NEWLINE_BEFORE_END = (
    "{% for message in messages %}"
    "<|im_start|>{{ message['role'] }}\n{{ message['content'] }}\n<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
PLAIN_TEXT = (
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n\n"
    "{% endfor %}{% if add_generation_prompt %}assistant: {% endif %}"
)


def test_trimming_template(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = LLAMA3_LIKE
    messages = chat(("user", " hi "), ("assistant", "  hello there \n"))
    sample = tokenize_conversation(fresh_tokenizer, messages, max_length=4096)
    assert sample.input_ids.tolist() == template_ids(fresh_tokenizer, messages)
    assert masked_segments(fresh_tokenizer, sample) == ["hello there" + END]


def test_whitespace_before_end_token_is_masked(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = NEWLINE_BEFORE_END
    messages = chat(("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "ciao"))
    assert_mask(fresh_tokenizer, messages, end="\n" + END)


def test_template_without_end_token_masks_content_only(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = PLAIN_TEXT
    messages = chat(("user", "hi"), ("assistant", "hello"), ("user", "bye"), ("assistant", "ciao"))
    sample = tokenize_conversation(fresh_tokenizer, messages, max_length=4096)
    # Byte-level BPE merges the space after "assistant:" into the answer's first token (" c"):
    # a token straddling the content boundary is masked, since it carries answer text.
    assert masked_segments(fresh_tokenizer, sample) == ["hello", " ciao"]


def test_template_that_rewrites_assistant_content_is_an_error(fresh_tokenizer: Any) -> None:
    fresh_tokenizer.chat_template = PLAIN_TEXT.replace(
        "message['content']", "message['content'] | upper"
    )
    with pytest.raises(DatasetError, match=r"data.jsonl:9: expected assistant message 1's content"):
        tokenize_conversation(
            fresh_tokenizer, chat(("user", "hi"), ("assistant", "hello")), 64, where="data.jsonl:9"
        )


def test_truncation_keeps_the_first_tokens(tokenizer: Any) -> None:
    messages = chat(
        ("user", "Give me a short fact about tides."), ("assistant", "Tides follow the moon.")
    )
    full = tokenize_conversation(tokenizer, messages, max_length=4096)
    exact = tokenize_conversation(tokenizer, messages, max_length=full.num_tokens)
    assert not exact.truncated and np.array_equal(exact.input_ids, full.input_ids)

    cut = tokenize_conversation(tokenizer, messages, max_length=full.num_tokens - 3)
    assert cut.truncated and cut.num_tokens == full.num_tokens - 3
    assert np.array_equal(cut.input_ids, full.input_ids[: cut.num_tokens])
    assert np.array_equal(cut.loss_mask, full.loss_mask[: cut.num_tokens])
    assert cut.loss_mask.sum() > 0

    # All assistant tokens cut away: kept, flagged, with an all-zero mask.
    first_assistant = int(np.argmax(full.loss_mask))
    prompt_only = tokenize_conversation(tokenizer, messages, max_length=first_assistant)
    assert prompt_only.truncated and prompt_only.num_tokens == first_assistant
    assert prompt_only.loss_mask.sum() == 0


def test_max_length_must_be_positive(tokenizer: Any) -> None:
    with pytest.raises(ValueError, match="found 0"):
        tokenize_conversation(tokenizer, chat(("user", "a"), ("assistant", "b")), max_length=0)


# --- fingerprints ----------------------------------------------------------------------------


def test_file_fingerprint_stable_and_sensitive(tmp_path: Path) -> None:
    path = tmp_path / "data.jsonl"
    data = bytearray(SAMPLE_DATA.read_bytes())
    path.write_bytes(bytes(data))
    first = fingerprint_file(path)
    assert first == fingerprint_file(path) == fingerprint_file(SAMPLE_DATA)
    assert len(first) == 32
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))
    assert fingerprint_file(path) != first


def test_file_fingerprint_spans_blocks(tmp_path: Path) -> None:
    path = tmp_path / "big.bin"
    payload = np.random.default_rng(0).integers(0, 256, size=9 * 1024 * 1024 + 17, dtype=np.uint8)
    path.write_bytes(payload.tobytes())
    assert fingerprint_file(path) == xxhash.xxh3_128_hexdigest(payload.tobytes())


def test_tokenizer_fingerprint(tokenizer: Any, fresh_tokenizer: Any) -> None:
    first = fingerprint_tokenizer(tokenizer)
    assert first == fingerprint_tokenizer(fresh_tokenizer)  # a second load of the same files
    fresh_tokenizer.chat_template = fresh_tokenizer.chat_template.replace("\n", "\n\n", 1)
    changed_template = fingerprint_tokenizer(fresh_tokenizer)
    assert changed_template != first
    fresh_tokenizer.add_tokens(["<|new|>"])
    assert fingerprint_tokenizer(fresh_tokenizer) not in (first, changed_template)


def test_bundled_dataset_is_the_generators_output() -> None:
    from hsx.data.sample_data import generate_conversations

    bundled = Path(__file__).resolve().parents[2] / "data" / "sample_conversations.jsonl"
    lines = bundled.read_text(encoding="utf-8").splitlines()
    assert [json.loads(line) for line in lines] == list(generate_conversations(300, seed=0))


def test_chat_length_conversations(tokenizer: Any) -> None:
    """The benchmark's chat-length conversations: lengths like ShareGPT/UltraChat, deterministic,
    with every assistant turn masked in."""
    from hsx.data.sample_data import generate_conversations

    conversations = list(generate_conversations(200, seed=3, chat_lengths=True))
    assert conversations == list(generate_conversations(200, seed=3, chat_lengths=True))
    lengths = []
    for conversation in conversations:
        sample = tokenize_conversation(tokenizer, conversation["messages"], max_length=1 << 16)
        assistant = [m["content"] for m in conversation["messages"] if m["role"] == "assistant"]
        assert sample.loss_mask.sum() >= sum(len(a.split()) for a in assistant) // 4
        lengths.append(sample.num_tokens)
    median = float(np.median(lengths))
    assert 400 < median < 1200, f"expected a chat-like median length, found {median}"
    assert max(lengths) > 3 * median, "expected a long tail"


def _walked_mask(
    ids: np.ndarray, offsets: np.ndarray, special: set[int], spans: Any, text: str
) -> np.ndarray:
    """The loss mask by walking tokens one by one (what the offset search must equal)."""
    mask = np.zeros(len(ids), dtype=np.uint8)
    token = 0
    for span_start, span_end in spans:
        while token < len(ids) and offsets[token][1] <= span_start:
            token += 1
        while token < len(ids) and offsets[token][0] < span_end:
            mask[token] = 1
            token += 1
        end = token
        while end < len(ids) and ids[end] not in special and not text[slice(*offsets[end])].strip():
            end += 1
        if end < len(ids) and ids[end] in special:
            mask[token : end + 1] = 1
            token = end + 1
    return mask


def test_batched_tokenization_equals_one_by_one_and_the_walked_mask(tokenizer: Any) -> None:
    """Planning tokenizes batches in one call: every sample equals its own tokenization
    (ids, mask, truncation), and the searched mask equals a token-by-token walk, also for
    offsets that go back (where the search falls back to walking)."""
    from hsx.data.sample_data import generate_conversations
    from hsx.data.tokenization import _assistant_spans, _normalize, _special_ids, render_chat

    conversations = [c["messages"] for c in generate_conversations(60, seed=5, chat_lengths=True)]
    for max_length in (1 << 16, 300):
        batched = tokenize_conversations(tokenizer, conversations, max_length)
        for messages, sample in zip(conversations, batched, strict=True):
            alone = tokenize_conversation(tokenizer, messages, max_length)
            assert np.array_equal(sample.input_ids, alone.input_ids)
            assert np.array_equal(sample.loss_mask, alone.loss_mask)
            assert sample.truncated == alone.truncated
    assert any(s.truncated for s in batched) and not all(s.truncated for s in batched)
    special = _special_ids(tokenizer)
    special_np = np.fromiter(special, dtype=np.int64)
    for messages in conversations[:20]:
        chat_ = _normalize(messages)
        text = render_chat(tokenizer, chat_, prompt=False)
        spans = _assistant_spans(tokenizer, chat_, text, "test")
        encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = np.asarray(encoding["input_ids"])
        offsets = np.asarray(encoding["offset_mapping"]).reshape(-1, 2)
        expected = _walked_mask(ids, offsets, special, spans, text)
        assert expected.sum() > 0
        searched = _loss_mask(ids, offsets, np.isin(ids, special_np), spans, text)
        assert np.array_equal(searched, expected)
        # A token whose offsets go back (as some tokenizers give for added tokens): walked.
        bent = offsets.copy()
        bent[1] = (0, 0)
        walked = _walked_mask(ids, bent, special, spans, text)
        assert np.array_equal(_loss_mask(ids, bent, np.isin(ids, special_np), spans, text), walked)


def test_line_byte_limit_is_exact_and_names_the_line(tmp_path: Path) -> None:
    limit = 1024
    line = json.dumps(
        {"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": ""}]}
    )
    pad = limit - len(line)
    fits = line.replace('"x"', '"' + "x" * (pad + 1) + '"')
    assert len(fits) == limit
    path = tmp_path / "data.jsonl"
    path.write_text(fits + "\n")  # its newline is byte limit + 1: still accepted
    assert len(list(iter_conversations(path, max_line_bytes=limit))) == 1
    path.write_text(fits + "\n" + fits.replace('"x', '"xx') + "\n")
    with pytest.raises(DatasetError, match=r"data.jsonl:2: expected a line of at most 1,024 bytes"):
        list(iter_conversations(path, max_line_bytes=limit))


def test_a_dataset_dict_needs_its_split(tmp_path: Path) -> None:
    """A save_to_disk folder of several splits is read by the split named, refused without
    one naming the splits; a file of an unknown kind is refused naming data.format."""
    import datasets

    rows = [
        {"id": f"r{i}", "messages": chat(("user", "q"), ("assistant", f"a{i}"))} for i in range(3)
    ]
    folder = tmp_path / "saved"
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(rows), "test": datasets.Dataset.from_list(rows[:1])}
    ).save_to_disk(str(folder))
    with pytest.raises(DatasetError, match=r"splits \['train', 'test'\]: expected data.split"):
        validate_dataset(folder)
    assert validate_dataset(folder, split="train") == 3
    assert [c.sample_id for c in iter_conversations(folder, split="test")] == ["r0"]
    text = tmp_path / "data.txt"
    text.write_text(json.dumps(rows[0]) + "\n")
    with pytest.raises(DatasetError, match=r"found 'data\.txt': set data\.format"):
        validate_dataset(text)
    assert validate_dataset(text, fmt="jsonl") == 1
