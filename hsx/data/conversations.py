"""A dataset row as a conversation: the columns and role names the anchors' data scripts use,
every field of a message that the chat template reads, or pre-tokenized ids with their mask.

Accepted rows (``data.columns`` renames any of these keys)::

    {"id": ..., "messages": [{"role": "user", "content": "..."}, ...], "tools": [...]}
    {"id": ..., "conversations": [{"role": ..., "content": ...}]}        # SpecForge, speculators
    {"id": ..., "conversations": [{"from": "human", "value": "..."}]}    # ShareGPT
    {"id": ..., "input_ids": [...], "loss_mask": [...]}                   # pre-tokenized

Ids come from ``id``, ``conversation_id`` or ``uuid``; a row without one gets ``hsx:INDEX`` (its
0-based position), a name a dataset's own ids may not use, so the two can never collide.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from hsx.data.sources import SourceRow, excerpt
from hsx.errors import DatasetError

ROLES = ("system", "user", "assistant", "tool")
MESSAGE_COLUMNS = ("messages", "conversations", "conversation")
ID_COLUMNS = ("id", "conversation_id", "uuid")
# ShareGPT's speakers, as SpecForge, speculators and LLaMA-Factory map them.
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    "tool": "tool",
    "function_call": "assistant",
    "observation": "tool",
    "function": "tool",
}
# What a chat template reads of a message besides role and content (tool calls, reasoning).
MESSAGE_FIELDS = ("tool_calls", "name", "tool_call_id", "reasoning_content")
DEFAULT_ID_PREFIX = "hsx:"


@dataclass(frozen=True)
class Conversation:
    """One checked row of a dataset."""

    index: int  # 0-based position among the rows read (before any is skipped)
    line_number: int  # 1-based line (JSONL) or row of its file, for errors and audits
    sample_id: str
    messages: tuple[dict[str, Any], ...] = ()
    tools: tuple[dict[str, Any], ...] | None = None
    byte_offset: int = 0  # of a JSONL line; the row's index in other formats
    has_own_id: bool = False
    where: str = ""  # file:line, or file and row: what errors name
    input_ids: np.ndarray | None = field(default=None, compare=False)  # [tokens] pre-tokenized
    loss_mask: np.ndarray | None = field(default=None, compare=False)  # [tokens]

    def as_chat(self) -> list[dict[str, Any]]:
        """The messages in the form ``apply_chat_template`` takes."""
        return [dict(message) for message in self.messages]

    @property
    def pretokenized(self) -> bool:
        return self.input_ids is not None


def conversation_of(
    row: SourceRow, index: int, columns: Mapping[str, str] | None = None
) -> Conversation:
    """The row as a conversation, or a DatasetError naming where it was read and what was
    expected. ``columns``: hsx's name -> the dataset's (``data.columns``)."""
    record = row.record
    if not isinstance(record, dict):
        raise DatasetError(
            f"{row.where}: expected a JSON object with a 'messages' list, "
            f"found {type(record).__name__} {excerpt(record)}"
        )
    names = dict(columns or {})
    sample_id, has_own_id = _sample_id(record, names, row, index)
    common: dict[str, Any] = {
        "index": index,
        "line_number": row.line_number,
        "sample_id": sample_id,
        "byte_offset": row.byte_offset,
        "has_own_id": has_own_id,
        "where": row.where,
    }
    ids_key, mask_key = names.get("input_ids", "input_ids"), names.get("loss_mask", "loss_mask")
    if ids_key in record:
        ids, mask = _pretokenized(record.get(ids_key), record.get(mask_key), row.where)
        return Conversation(**common, input_ids=ids, loss_mask=mask)
    key = names.get("messages") or next((k for k in MESSAGE_COLUMNS if k in record), None)
    raw = record.get(key) if key else None
    if not isinstance(raw, list) or not raw:
        found = f"no {' or '.join(MESSAGE_COLUMNS)} key" if key is None else excerpt(raw)
        raise DatasetError(
            f"{row.where}: expected a non-empty 'messages' list, found {found} "
            f"(keys: {sorted(record)})"
        )
    messages = tuple(_message(m, f"{row.where}: message {i}") for i, m in enumerate(raw))
    if not any(m["role"] == "assistant" for m in messages):
        # Nothing to train on: EAGLE-3 learns from assistant tokens only.
        raise DatasetError(
            f"{row.where}: expected at least one 'assistant' message, "
            f"found roles {[m['role'] for m in messages]}"
        )
    return Conversation(**common, messages=messages, tools=_tools(record, names, row.where))


def _sample_id(
    record: dict[str, Any], names: dict[str, str], row: SourceRow, index: int
) -> tuple[str, bool]:
    keys = [names["id"]] if "id" in names else list(ID_COLUMNS)
    for key in keys:
        value = record.get(key)
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, str | int):
            raise DatasetError(
                f"{row.where}: expected '{key}' to be a string, found {type(value).__name__} "
                f"{excerpt(value)}"
            )
        text = str(value)
        if text.startswith(DEFAULT_ID_PREFIX):
            raise DatasetError(
                f"{row.where}: expected an '{key}' not starting with {DEFAULT_ID_PREFIX!r} "
                f"(hsx names rows without an id so), found {excerpt(text)}"
            )
        return text, True
    return f"{DEFAULT_ID_PREFIX}{index}", False


def _message(message: Any, at: str) -> dict[str, Any]:
    if not isinstance(message, dict):
        raise DatasetError(
            f"{at}: expected an object with 'role' and 'content' (or ShareGPT's 'from' and "
            f"'value'), found {type(message).__name__} {excerpt(message)}"
        )
    if "role" in message:
        role, content = message.get("role"), message.get("content")
    else:
        speaker = message.get("from")
        role = SHAREGPT_ROLES.get(speaker) if isinstance(speaker, str) else None
        if role is None:
            raise DatasetError(
                f"{at}: expected 'role', or a ShareGPT 'from' in {sorted(SHAREGPT_ROLES)}, "
                f"found {excerpt(speaker) if 'from' in message else sorted(message)}"
            )
        content = message.get("value")
    if role not in ROLES:
        raise DatasetError(f"{at}: expected a role in {ROLES}, found {excerpt(role)}")
    kept = {"role": role, "content": _text(content, message, at)}
    for name in MESSAGE_FIELDS:
        if message.get(name) is not None:
            kept[name] = message[name]
    return kept


def _text(content: Any, message: dict[str, Any], at: str) -> str:
    """A message's text: a string, or the text parts of a multi-part content joined; None only
    beside tool calls."""
    if isinstance(content, str):
        return content
    if content is None and message.get("tool_calls"):
        return ""
    if isinstance(content, list):
        texts = []
        for position, part in enumerate(content):
            kind = part.get("type") if isinstance(part, dict) else None
            if kind != "text" or not isinstance(part.get("text"), str):
                raise DatasetError(
                    f"{at}: part {position}: expected text parts only ({{'type': 'text', 'text': "
                    f"...}}): hsx extracts text models, found {excerpt(part)}"
                )
            texts.append(part["text"])
        return "".join(texts)
    raise DatasetError(
        f"{at}: expected string 'content' (or a list of text parts), found "
        f"{type(content).__name__} {excerpt(content)}"
    )


def _tools(record: dict[str, Any], names: dict[str, str], where: str) -> tuple[dict, ...] | None:
    tools = record.get(names.get("tools", "tools"))
    if tools is None:
        return None
    if isinstance(tools, str):  # many sets store the schema list as JSON text
        import json

        try:
            tools = json.loads(tools)
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{where}: expected 'tools' as a list or JSON text: {exc}") from exc
    if not isinstance(tools, list) or not all(isinstance(t, dict) for t in tools):
        raise DatasetError(
            f"{where}: expected 'tools' to be a list of objects, found {excerpt(tools)}"
        )
    return tuple(tools) if tools else None


def _pretokenized(ids: Any, mask: Any, where: str) -> tuple[np.ndarray, np.ndarray]:
    if not isinstance(ids, list | np.ndarray) or len(ids) == 0:
        raise DatasetError(
            f"{where}: expected 'input_ids' to be a non-empty list, found {excerpt(ids)}"
        )
    if not isinstance(mask, list | np.ndarray):
        raise DatasetError(
            f"{where}: expected 'loss_mask' beside 'input_ids' (pre-tokenized rows), found "
            f"{excerpt(mask)}"
        )
    try:
        ids_np = np.asarray(ids, dtype=np.int64)  # [tokens]
        mask_np = np.asarray(mask, dtype=np.int64)  # [tokens]
    except (TypeError, ValueError) as exc:
        raise DatasetError(f"{where}: expected integer 'input_ids' and 'loss_mask': {exc}") from exc
    if ids_np.ndim != 1 or mask_np.shape != ids_np.shape:
        raise DatasetError(
            f"{where}: expected 'loss_mask' as long as 'input_ids' ({ids_np.shape[0]}), found "
            f"{mask_np.shape[0] if mask_np.ndim else 'a scalar'}"
        )
    if not np.isin(mask_np, (0, 1)).all():
        raise DatasetError(
            f"{where}: expected 'loss_mask' of 0 and 1, found {sorted(set(mask_np.tolist()))[:6]}"
        )
    if ids_np.min() < 0 or ids_np.max() > np.iinfo(np.int32).max:
        raise DatasetError(f"{where}: expected token ids >= 0, found {int(ids_np.min())}")
    return ids_np.astype(np.int32), mask_np.astype(np.uint8)
