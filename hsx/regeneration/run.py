"""One regeneration, built once at the entry point (settings, tokenizer, chat template, the
generator, the output, the chunks) and run chunk by chunk: ``regenerate(index)`` is what a task
calls. A chunk's conversations are generated together, each sending its next turn as soon as its
last one is answered, each request with its own seed so that a retried or resumed chunk generates
the same tokens."""

from __future__ import annotations

import json
import logging
import time
from collections import Counter
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import xxhash

from hsx.data.conversations import Conversation
from hsx.data.tokenization import fingerprint_dataset, iter_conversations
from hsx.engine.options import resolve_dtype
from hsx.errors import ConfigError
from hsx.interrupt import RunInterruptedError, stop_reason, stop_requested
from hsx.model.config import read_config
from hsx.model.limits import model_max_len
from hsx.plan.building import config_hash
from hsx.plan.frozen_inputs import (
    chat_template_fingerprint,
    model_revision,
    vocabulary_fingerprint,
    weights_fingerprint,
)
from hsx.regeneration.generators import (
    GenerationRequest,
    TextGenerator,
    check_sampling,
    effective_sampling,
    model_sampling_defaults,
)
from hsx.regeneration.output import PartCommit, RegeneratedOutput, part_digest
from hsx.regeneration.turns import (
    END_OF_THINKING,
    ChatTemplate,
    ConversationRegeneration,
    GeneratedText,
    SampleDroppedError,
    SampleError,
    TurnPolicy,
    regenerated_turns,
)
from settings.regenerate import RegenerateSettings

logger = logging.getLogger(__name__)

# Chunks generating at once: their turns share the engine's batches, so one chunk's last long
# answers overlap the next chunk's first turn instead of leaving the engine half idle.
CHUNKS_IN_FLIGHT = 3

# How often a chunk waiting on its answers looks for a stop request.
STOP_POLL_S = 1.0


def turn_seed(run_seed: int, sample_id: str, message: int) -> int:
    """The seed of one turn of one sample: the same on every attempt, whatever the batch."""
    return int(xxhash.xxh64_intdigest(f"{run_seed}\0{sample_id}\0{message}".encode()) & 0x7FFFFFFF)


def load_tokenizer(model: Path) -> Any:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(model))
    if not tokenizer.chat_template:
        raise ConfigError(
            f"{model}: expected a tokenizer with a chat template (chat_template.jinja or "
            "tokenizer_config.json's chat_template) to render conversations, found none"
        )
    return tokenizer


def turn_policy(settings: RegenerateSettings, tokenizer: Any) -> TurnPolicy:
    generation = settings.generation
    end_id = None
    if generation.reasoning == "drop":
        end_id = tokenizer.convert_tokens_to_ids(END_OF_THINKING)
        if not isinstance(end_id, int) or end_id == tokenizer.unk_token_id:
            raise ConfigError(
                f"generation.reasoning=drop: expected {END_OF_THINKING!r} to be one token of "
                f"{settings.model}'s vocabulary, found {end_id!r}"
            )
    return TurnPolicy(generation.turns, generation.on_length, generation.reasoning, end_id)


@dataclass
class RegenerationPlan:
    """The dataset cut into chunks of conversations, and what the output froze."""

    chunks: list[list[Conversation]]
    frozen: dict[str, Any]
    max_model_len: int
    sampling: dict[str, Any]  # sent whole with every request (generators.effective_sampling)
    conversations: int = field(init=False)

    def __post_init__(self) -> None:
        self.conversations = sum(len(chunk) for chunk in self.chunks)


def plan_regeneration(settings: RegenerateSettings, tokenizer: Any) -> RegenerationPlan:
    """Read and check every conversation (a bad row fails here, before any load), cut the
    chunks, and gather the frozen inputs."""
    check_sampling(settings.generation.sampling)
    data, generation = settings.data, settings.generation
    conversations: list[Conversation] = []
    for conversation in iter_conversations(
        settings.dataset, data.max_line_bytes, data.format, data.split, data.columns
    ):
        if data.max_samples is not None and len(conversations) >= data.max_samples:
            break
        regenerated_turns(conversation, generation.turns)  # raises naming the row
        conversations.append(conversation)
    size = generation.conversations_per_chunk
    chunks = [conversations[i : i + size] for i in range(0, len(conversations), size)]
    config = read_config(settings.model)
    max_model_len = settings.engine.max_model_len or model_max_len(config, settings.model).tokens
    frozen = {
        "model_config_hash": config_hash(config),
        "weights_fingerprint": weights_fingerprint(
            settings.model, settings.engine.load_format, settings.engine.seed
        ),
        "model_revision": model_revision(settings.model, config),
        "vocabulary_fingerprint": vocabulary_fingerprint(tokenizer),
        "chat_template_fingerprint": chat_template_fingerprint(tokenizer),
        "chat_template_kwargs": generation.chat_template_kwargs,
        "sampling": generation.sampling,
        **_model_defaults_frozen(settings.model),
        "max_tokens": generation.max_tokens,
        "seed": generation.seed,
        "turns": generation.turns,
        "on_length": generation.on_length,
        "reasoning": generation.reasoning,
        "dataset_fingerprint": fingerprint_dataset(settings.dataset, data.format, data.split),
        "dataset_reading": {
            "format": data.format,
            "split": data.split,
            "columns": dict(sorted(data.columns.items())),
            "max_samples": data.max_samples,
        },
        "conversations_per_chunk": size,
        "engine_dtype": resolve_dtype(settings.engine, config),
        "max_model_len": max_model_len,
    }
    sampling = effective_sampling(settings.model, generation.sampling)
    return RegenerationPlan(chunks, frozen, max_model_len, sampling)


def _model_defaults_frozen(model_dir: Path) -> dict[str, Any]:
    """The model's sampling defaults change what is generated: frozen where it sets any (an
    output made without them keeps resuming)."""
    defaults = model_sampling_defaults(model_dir)
    return {"model_sampling_defaults": defaults} if defaults else {}


@dataclass
class _ChunkTally:
    failed: list[dict[str, Any]] = field(default_factory=list)
    dropped: list[dict[str, Any]] = field(default_factory=list)


class RegenerationRun:
    """What every chunk of one run shares, built once by the flow."""

    def __init__(
        self,
        settings: RegenerateSettings,
        tokenizer: Any,
        plan: RegenerationPlan,
        generator: TextGenerator,
        output: RegeneratedOutput,
    ) -> None:
        self.settings = settings
        self.template = ChatTemplate(tokenizer, settings.generation.chat_template_kwargs)
        self.policy = turn_policy(settings, tokenizer)
        self.plan = plan
        self.generator = generator
        self.output = output

    def pending(self) -> list[int]:
        done = self.output.committed_indices()
        return [i for i in range(len(self.plan.chunks)) if i not in done]

    def regenerate(
        self, index: int, run_id: str, attempt: int, flow_run_attempt: int = 1
    ) -> PartCommit | None:
        """Generate chunk ``index`` and commit it; None when it was committed already.
        ``attempt`` is the chunk task's, ``flow_run_attempt`` the flow run's."""
        if self.output.is_committed(index):
            return None
        started = time.perf_counter()
        tally = _ChunkTally()
        states = [
            ConversationRegeneration(
                conversation,
                self.template,
                self.policy,
                regenerated_turns(conversation, self.policy.turns),
            )
            for conversation in self.plan.chunks[index]
        ]
        self._generate(states, tally)
        kept = [s for s in states if s.done]  # a failed or dropped one stopped short
        payload = b"".join(json.dumps(s.row()).encode() + b"\n" for s in kept)
        reasons = Counter(turn.finish_reason for s in kept for turn in s.turns)
        commit = PartCommit(
            index=index,
            conversations=len(states),
            rows=len(kept),
            generated_tokens=sum(t.generated_tokens for s in kept for t in s.turns),
            xxh3=part_digest(payload),
            nbytes=len(payload),
            seconds=round(time.perf_counter() - started, 3),
            failed=tally.failed,
            dropped=tally.dropped,
            finish_reasons=dict(sorted(reasons.items())),
            run_id=run_id,
            attempt=attempt,
            finished_at=time.time(),
            flow_run_attempt=flow_run_attempt,
        )
        if stop_requested():  # never commit after a stop was asked for
            raise RunInterruptedError(f"chunk {index} abandoned before its commit: {stop_reason()}")
        if not self.output.write_part(index, payload, commit):
            logger.warning("chunk %d was committed by another attempt; its record stands", index)
        return commit

    def _generate(self, states: list[ConversationRegeneration], tally: _ChunkTally) -> None:
        """Every conversation turn by turn, each sending its next turn as soon as its last answer
        arrives: no barrier per turn, so a short conversation never waits for the chunk's
        longest answer, and the engine's batches stay full."""
        sampling = self.plan.sampling
        waiting: dict[Future[GeneratedText], tuple[ConversationRegeneration, int]] = {}

        def send(ready: list[ConversationRegeneration]) -> None:
            asked = [(s, r) for s in ready if (r := self._next_request(s, tally)) is not None]
            futures = self.generator.submit([r for _, r in asked], sampling) if asked else []
            for (state, request), future in zip(asked, futures, strict=True):
                waiting[future] = (state, request.seed)

        send(states)
        while waiting:
            if stop_requested():
                raise RunInterruptedError(f"chunk abandoned between turns: {stop_reason()}")
            finished, _ = wait(waiting, timeout=STOP_POLL_S, return_when=FIRST_COMPLETED)
            ready = []
            for future in finished:
                state, seed = waiting.pop(future)
                try:
                    state.accept(future.result(), seed)  # an EngineError fails the chunk
                except SampleError as exc:
                    tally.failed.append({"id": state.conversation.sample_id, "error": str(exc)})
                    continue
                except SampleDroppedError as exc:
                    tally.dropped.append({"id": state.conversation.sample_id, "reason": str(exc)})
                    continue
                if not state.done:
                    ready.append(state)
            send(ready)

    def _next_request(
        self, state: ConversationRegeneration, tally: _ChunkTally
    ) -> GenerationRequest | None:
        """The request of the conversation's next turn; None (counted) when it cannot be asked."""
        limit = self.plan.max_model_len
        try:
            prompt = state.next_prompt()
            if len(prompt) >= limit:
                raise SampleError(
                    f"{state.where}: expected the prompt of assistant message "
                    f"{state.targets[len(state.turns)]} to fit engine.max_model_len {limit} "
                    f"with room to generate, found {len(prompt)} tokens"
                )
        except SampleError as exc:
            tally.failed.append({"id": state.conversation.sample_id, "error": str(exc)})
            return None
        seed = turn_seed(
            self.settings.generation.seed,
            state.conversation.sample_id,
            state.targets[len(state.turns)],
        )
        max_tokens = min(self.settings.generation.max_tokens, limit - len(prompt))
        return GenerationRequest(prompt, max_tokens, seed)
