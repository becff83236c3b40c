"""One conversation regenerated turn by turn, keeping the exact token ids.

Each assistant turn's prompt is the token ids of everything before it, where every earlier
regenerated turn is the ids the engine produced (never a re-tokenization of its text), followed by
the template's own text between turns, tokenized. How: the chat template renders the history with
the generation prompt (P) and again through the regenerated turn (W); W starts with P; what follows
the turn's content in W is its closing (ChatML's ``<|im_end|>\\n``), and what the next prompt adds
after W is the next user (system, tool) text and generation prompt. Templates that rewrite earlier
turns once a later one is added (some drop past reasoning) break that prefix rule: such a
conversation fails with its own error, counted, and is never written with ids that do not match.

Only the generated tokens are trained on (loss mask 1): a turn the draft should learn is one the
target produced. Closing tokens the engine did not produce (a turn cut by max_tokens) are not.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from hsx.data.conversations import Conversation
from hsx.data.tokenization import render_chat
from hsx.errors import DatasetError

END_OF_THINKING = "</think>"


class SampleError(Exception):
    """One conversation cannot be regenerated (an empty generation, a template that rewrites
    earlier turns, too long for the engine): counted and listed in the chunk's record; the other
    conversations go on."""


class SampleDroppedError(Exception):
    """A conversation left out by a setting (generation.on_length = drop): counted apart."""


@dataclass(frozen=True)
class GeneratedText:
    """What the engine produced for one turn."""

    token_ids: tuple[int, ...]
    text: str  # decoded without special tokens (replaced by the tokenizer's own decode)
    finish_reason: str  # "stop", "length", ...


@dataclass(frozen=True)
class TurnRecord:
    """One regenerated turn, as the output row records it."""

    message: int  # index of the assistant message in the conversation
    prompt_tokens: int
    generated_tokens: int
    finish_reason: str
    seed: int


@dataclass(frozen=True)
class TurnPolicy:
    """The generation settings that shape a row (from settings.GenerationSettings)."""

    turns: str = "all"  # all | last
    on_length: str = "keep"  # keep | mark | drop
    reasoning: str = "keep"  # keep | drop
    end_of_thinking_id: int | None = None  # the '</think>' token, where reasoning = drop


def regenerated_turns(conversation: Conversation, turns: str) -> list[int]:
    """Indices of the assistant messages to regenerate; a DatasetError naming the row when there
    is none, or when no user message comes before the first (nothing to answer)."""
    where = conversation.where or f"conversation {conversation.index}"
    if conversation.pretokenized:
        raise DatasetError(
            f"{where}: expected messages to regenerate, found a pre-tokenized row (input_ids)"
        )
    messages = conversation.messages
    # Assistant turns that call tools are kept: their results in the dataset answer those calls.
    candidates = [
        i for i, m in enumerate(messages) if m["role"] == "assistant" and not m.get("tool_calls")
    ]
    if not candidates:
        raise DatasetError(
            f"{where}: expected an assistant message without tool calls to regenerate, found "
            f"roles {[m['role'] for m in messages]}"
        )
    targets = candidates if turns == "all" else candidates[-1:]
    if not any(m["role"] == "user" for m in messages[: targets[0]]):
        raise DatasetError(
            f"{where}: expected a user message before assistant message {targets[0]}, found "
            f"roles {[m['role'] for m in messages[: targets[0] + 1]]}"
        )
    return targets


class ChatTemplate:
    """The tokenizer's chat template and its tokenization, as regeneration uses them."""

    def __init__(self, tokenizer: Any, template_kwargs: dict[str, Any] | None = None) -> None:
        self.tokenizer = tokenizer
        self.kwargs = dict(template_kwargs or {})

    def render(self, messages: list[dict[str, Any]], prompt: bool, tools: Any = None) -> str:
        return render_chat(self.tokenizer, messages, prompt, tools, self.kwargs)

    def decode(self, ids: tuple[int, ...]) -> str:
        """A turn's text from its ids (the engine's own text may hold back a last partial
        character; this is the same text for every engine home)."""
        return str(self.tokenizer.decode(list(ids), skip_special_tokens=True))

    def encode(self, text: str) -> list[int]:
        # The template writes BOS and friends into the text itself.
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


@dataclass
class ConversationRegeneration:
    """One conversation's state between its turns: ids so far, their loss mask, the messages
    with the turns regenerated so far, and the rendered text the ids stand for."""

    conversation: Conversation
    template: ChatTemplate
    policy: TurnPolicy
    targets: list[int]
    ids: list[int] = field(default_factory=list)
    mask: list[int] = field(default_factory=list)
    turns: list[TurnRecord] = field(default_factory=list)
    messages: list[dict[str, Any]] = field(default_factory=list)
    _rendered: str = ""  # what ``ids`` stand for, as the template renders it
    _prompt_text: str = ""

    def __post_init__(self) -> None:
        self.messages = self.conversation.as_chat()

    @property
    def done(self) -> bool:
        return len(self.turns) == len(self.targets)

    @property
    def where(self) -> str:
        return self.conversation.where or f"conversation {self.conversation.index}"

    def next_prompt(self) -> list[int]:
        """The prompt ids of the next turn to generate."""
        target = self.targets[len(self.turns)]
        text = self.template.render(
            self.messages[:target], prompt=True, tools=self.conversation.tools
        )
        if not self.ids:
            added = self.template.encode(text)
        elif text.startswith(self._rendered):
            added = self.template.encode(text[len(self._rendered) :])
        else:
            raise SampleError(
                f"{self.where}: the chat template renders the conversation before assistant "
                f"message {target} differently once later messages are added (it rewrites "
                "earlier turns), so the regenerated token ids cannot be kept"
            )
        self.ids += added
        self.mask += [0] * len(added)
        self._prompt_text = text
        return list(self.ids)

    def accept(self, generated: GeneratedText, seed: int) -> None:
        """Take the engine's answer to the last prompt: its ids, then the turn's closing."""
        target = self.targets[len(self.turns)]
        generated = GeneratedText(
            generated.token_ids, self.template.decode(generated.token_ids), generated.finish_reason
        )
        if not generated.token_ids or not generated.text.strip():
            raise SampleError(
                f"{self.where}: expected text for assistant message {target}, the engine "
                f"generated {len(generated.token_ids)} tokens of no text "
                f"(finish_reason {generated.finish_reason!r})"
            )
        cut = generated.finish_reason == "length"
        if cut and self.policy.on_length == "drop":
            raise SampleDroppedError(f"{self.where}: assistant message {target} cut by max_tokens")
        message, trained = self._message(
            generated, train=not (cut and self.policy.on_length == "mark")
        )
        self.messages[target] = message
        closing = self._closing(target, str(message["content"]), generated)
        prompt_tokens = len(self.ids)
        self.ids += list(generated.token_ids) + closing
        self.mask += trained + [0] * len(closing)
        self.turns.append(
            TurnRecord(
                target, prompt_tokens, len(generated.token_ids), generated.finish_reason, seed
            )
        )

    def _message(self, generated: GeneratedText, train: bool) -> tuple[dict[str, Any], list[int]]:
        """The assistant message and the loss mask of the generated ids. Reasoning dropped: the
        ids through the end-of-thinking token go to reasoning_content, untrained (split by id:
        the token may be one a decode skips)."""
        ids = list(generated.token_ids)
        mask = [int(train)] * len(ids)
        end = self.policy.end_of_thinking_id
        if self.policy.reasoning != "drop" or end is None or end not in ids:
            return {"role": "assistant", "content": generated.text}, mask
        upto = ids.index(end) + 1
        thinking = self.template.decode(tuple(ids[: upto - 1]))
        content = self.template.decode(tuple(ids[upto:])).lstrip()
        if not content.strip():
            raise SampleError(
                f"{self.where}: expected an answer after the reasoning of assistant message "
                f"{self.targets[len(self.turns)]}, found none "
                f"(finish_reason {generated.finish_reason!r})"
            )
        mask[:upto] = [0] * upto
        thinking = thinking.strip().removeprefix("<think>").strip()
        return {"role": "assistant", "content": content, "reasoning_content": thinking}, mask

    def _closing(self, target: int, content: str, generated: GeneratedText) -> list[int]:
        """The ids the template puts after the turn's content that the engine did not produce."""
        through = self.template.render(
            self.messages[: target + 1], prompt=False, tools=self.conversation.tools
        )
        if not through.startswith(self._prompt_text):
            raise SampleError(
                f"{self.where}: the chat template renders assistant message {target} without "
                "the generation prompt it was asked with (its prompt is not a prefix of the "
                "conversation through it)"
            )
        rendered_turn = through[len(self._prompt_text) :]
        found, needle = -1, content
        for needle in dict.fromkeys((content, content.strip())):
            found = rendered_turn.rfind(needle)
            if found >= 0:
                break
        if found < 0 or not needle:
            raise SampleError(
                f"{self.where}: expected the regenerated content of assistant message {target} "
                "in the chat template's rendering, found it rewritten"
            )
        closing = self.template.encode(rendered_turn[found + len(needle) :])
        self._rendered = through
        ids = generated.token_ids
        if generated.finish_reason == "stop" and closing and ids and ids[-1] == closing[0]:
            return closing[1:]  # the engine produced the end-of-turn token itself
        return closing

    def row(self) -> dict[str, Any]:
        """The output row: pre-tokenized (what extraction reads) and its messages."""
        last = self.targets[-1]
        row: dict[str, Any] = {
            "id": self.conversation.sample_id,
            "messages": self.messages[: last + 1],
            "input_ids": self.ids,
            "loss_mask": self.mask,
            "hsx_turns": [turn.__dict__ for turn in self.turns],
        }
        if self.conversation.tools:
            row["tools"] = list(self.conversation.tools)
        return row
