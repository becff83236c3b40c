"""Regeneration's turn bookkeeping (hsx.regeneration.turns) with a real trained tokenizer and
real chat templates: the ids each prompt holds, the closing tokens added, the loss mask, and the
cases a template or an answer makes impossible. The engine's answers are token ids given here
(what an engine returned); the engine itself is tested in tests/integration/test_regenerate.py."""

from __future__ import annotations

from typing import Any

import pytest

from hsx.data.conversations import Conversation
from hsx.data.tiny_models import train_tokenizer
from hsx.errors import DatasetError
from hsx.regeneration.turns import (
    ChatTemplate,
    ConversationRegeneration,
    GeneratedText,
    SampleDroppedError,
    SampleError,
    TurnPolicy,
    regenerated_turns,
)

pytestmark = pytest.mark.timeout(120)

# Llama-3's way: contents trimmed, each turn closed by one end-of-turn token.
TRIMMING = (
    "{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{{ m['content'] | trim }}<|eos|>{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
# Drops the content of assistant turns before the last user message (as templates that drop
# past reasoning do): earlier turns render differently once a later one is added.
REWRITING = (
    "{{ bos_token }}{% set last = namespace(i=0) %}{% for m in messages %}"
    "{% if m['role'] == 'user' %}{% set last.i = loop.index0 %}{% endif %}{% endfor %}"
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' and loop.index0 < last.i %}-{% else %}{{ m['content'] }}"
    "{% endif %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


@pytest.fixture
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    train_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def conversation(*turns: tuple[str, str]) -> Conversation:
    return Conversation(
        index=0,
        line_number=1,
        sample_id="s0",
        messages=tuple({"role": r, "content": c} for r, c in turns),
        where="data.jsonl:1",
    )


CHAT = conversation(
    ("system", "Be brief."),
    ("user", "Name a river."),
    ("assistant", "The Nile."),
    ("user", "And a lake?"),
    ("assistant", "Lake Baikal."),
)


def answer(tokenizer: Any, text: str, finish: str = "length", end: str = "") -> GeneratedText:
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if end:
        ids = [*ids, tokenizer.convert_tokens_to_ids(end)]
    return GeneratedText(tuple(ids), text, finish)


def run_turns(state: ConversationRegeneration, answers: list[GeneratedText]) -> list[list[int]]:
    prompts = []
    for generated in answers:
        prompts.append(state.next_prompt())
        state.accept(generated, seed=7)
    return prompts


def test_each_prompt_holds_the_earlier_generated_ids_and_the_template_text_between(
    tokenizer: Any,
) -> None:
    template = ChatTemplate(tokenizer)
    state = ConversationRegeneration(CHAT, template, TurnPolicy(), regenerated_turns(CHAT, "all"))
    first, second = (
        answer(tokenizer, "Danube river"),
        answer(tokenizer, " Lake Tahoe", "stop", "<|im_end|>"),
    )
    prompts = run_turns(state, [first, second])
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    newline = tokenizer("\n", add_special_tokens=False)["input_ids"]
    # The first prompt: the template's rendering of the turns before it, tokenized.
    expected = template.encode(template.render(list(CHAT.as_chat())[:2], prompt=True))
    assert prompts[0] == expected
    # The second: all of the first, the generated ids as generated, the closing the engine did
    # not produce (cut by max_tokens: <|im_end|> and the newline), then the next user turn.
    cut = len(expected) + len(first.token_ids)
    assert prompts[1][: len(expected)] == expected
    assert prompts[1][len(expected) : cut] == list(first.token_ids)
    assert prompts[1][cut : cut + 1 + len(newline)] == [im_end, *newline]
    rendered = template.render(state.messages[:4], prompt=True)
    assert tokenizer.decode(prompts[1]) == rendered  # the ids stand for the rendering
    # Stopped by its own <|im_end|>: only the newline is added, and the <|im_end|> is trained on.
    assert state.ids[len(prompts[1]) :] == [*second.token_ids, *newline]
    assert state.mask == [0] * len(expected) + [1] * len(first.token_ids) + [0] * (
        len(prompts[1]) - cut
    ) + [1] * len(second.token_ids) + [0] * len(newline)
    row = state.row()
    assert row["messages"][2]["content"] == "Danube river"
    assert row["messages"][4]["content"] == tokenizer.decode(
        second.token_ids, skip_special_tokens=True
    )
    assert [t["message"] for t in row["hsx_turns"]] == [2, 4]
    assert [t["finish_reason"] for t in row["hsx_turns"]] == ["length", "stop"]


def test_a_trimming_template_keeps_the_untrimmed_generated_ids(tokenizer: Any) -> None:
    tokenizer.chat_template = TRIMMING
    template = ChatTemplate(tokenizer)
    state = ConversationRegeneration(CHAT, template, TurnPolicy(), regenerated_turns(CHAT, "all"))
    spaced = answer(tokenizer, "  The Volga  ", "stop", "<|eos|>")
    prompts = run_turns(state, [spaced, answer(tokenizer, "Lake Como")])
    start = len(prompts[0])
    assert prompts[1][start : start + len(spaced.token_ids)] == list(spaced.token_ids)
    # The end-of-turn token was generated: nothing is added between it and the next user turn.
    after = prompts[1][start + len(spaced.token_ids) :]
    assert tokenizer.decode(after).startswith("<|im_start|>user")


def test_a_template_that_rewrites_earlier_turns_fails_that_conversation(tokenizer: Any) -> None:
    tokenizer.chat_template = REWRITING
    state = ConversationRegeneration(
        CHAT, ChatTemplate(tokenizer), TurnPolicy(), regenerated_turns(CHAT, "all")
    )
    state.next_prompt()
    state.accept(answer(tokenizer, "The Amazon"), seed=1)
    with pytest.raises(SampleError, match="rewrites earlier turns"):
        state.next_prompt()


@pytest.mark.parametrize("on_length", ["keep", "mark", "drop"])
def test_a_turn_cut_by_max_tokens_is_kept_marked_or_dropped(tokenizer: Any, on_length: str) -> None:
    state = ConversationRegeneration(
        CHAT, ChatTemplate(tokenizer), TurnPolicy(turns="last", on_length=on_length), [4]
    )
    prompt = state.next_prompt()
    cut = answer(tokenizer, "Lake Victoria is", "length")
    if on_length == "drop":
        with pytest.raises(SampleDroppedError, match="cut by max_tokens"):
            state.accept(cut, seed=1)
        return
    state.accept(cut, seed=1)
    trained = state.mask[len(prompt) : len(prompt) + len(cut.token_ids)]
    assert trained == [int(on_length == "keep")] * len(cut.token_ids)
    assert sum(state.mask[: len(prompt)]) == 0  # turns=last: the kept turns are not trained on


def test_an_empty_generation_is_an_error_for_that_conversation(tokenizer: Any) -> None:
    state = ConversationRegeneration(
        CHAT, ChatTemplate(tokenizer), TurnPolicy(), regenerated_turns(CHAT, "all")
    )
    state.next_prompt()
    eos = tokenizer.convert_tokens_to_ids("<|eos|>")
    with pytest.raises(SampleError, match="generated 1 tokens of no text"):
        state.accept(GeneratedText((eos,), "", "stop"), seed=1)


def test_reasoning_dropped_moves_it_out_of_the_content_and_the_loss(tokenizer: Any) -> None:
    tokenizer.add_special_tokens({"additional_special_tokens": ["<think>", "</think>"]})
    end = tokenizer.convert_tokens_to_ids("</think>")
    policy = TurnPolicy(turns="last", reasoning="drop", end_of_thinking_id=end)
    state = ConversationRegeneration(CHAT, ChatTemplate(tokenizer), policy, [4])
    prompt = state.next_prompt()
    thought = answer(tokenizer, "<think>a lake</think>Lake Ohrid", "length")
    state.accept(thought, seed=1)
    message = state.messages[4]
    assert message["content"] == "Lake Ohrid" and message["reasoning_content"] == "a lake"
    ids = list(thought.token_ids)
    upto = ids.index(end) + 1
    generated = state.mask[len(prompt) : len(prompt) + len(ids)]
    assert generated == [0] * upto + [1] * (len(ids) - upto)
    assert state.ids[len(prompt) : len(prompt) + len(ids)] == ids  # the ids stay as generated

    only = ConversationRegeneration(CHAT, ChatTemplate(tokenizer), policy, [4])
    only.next_prompt()
    with pytest.raises(SampleError, match="expected an answer after the reasoning"):
        only.accept(answer(tokenizer, "<think>still thinking</think>", "length"), seed=1)


def test_rows_without_a_user_message_or_with_ids_only_are_refused(tokenizer: Any) -> None:
    no_user = conversation(("system", "s"), ("assistant", "a"))
    with pytest.raises(DatasetError, match=r"expected a user message before assistant message 1"):
        regenerated_turns(no_user, "all")
    only_calls = Conversation(
        index=0,
        line_number=1,
        sample_id="t",
        messages=(
            {"role": "user", "content": "u"},
            {"role": "assistant", "content": "", "tool_calls": [{"name": "f"}]},
        ),
        where="data.jsonl:1",
    )
    with pytest.raises(DatasetError, match="without tool calls"):
        regenerated_turns(only_calls, "all")
    assert regenerated_turns(CHAT, "last") == [4] and regenerated_turns(CHAT, "all") == [2, 4]
