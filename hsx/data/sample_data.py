"""A deterministic generator of chat conversations (OpenAI ``messages`` form).

The bundled dataset ``data/sample_conversations.jsonl`` is this generator's output
(``python -m hsx.data.sample_data data/sample_conversations.jsonl``): short conversations, quick to
extract in tests and the demo; the benchmark uses it to make datasets ten times larger with the
same shape. ``chat_lengths=True`` makes conversations as long as those of the chat datasets
EAGLE-3 drafters are trained on (ShareGPT, UltraChat: a few turns with long answers, hundreds to
thousands of tokens). No dataset can be downloaded on these machines.
"""

from __future__ import annotations

import json
import math
import random
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

_TOPICS = [
    ("rivers", "Rivers carry water from high ground to the sea and shape the land they cross."),
    ("bread", "Bread rises because yeast turns sugar into carbon dioxide trapped in the dough."),
    ("tides", "Tides follow the pull of the moon and, to a lesser degree, the sun."),
    ("compilers", "A compiler turns source code into instructions a machine can run."),
    ("bees", "Bees gather nectar and pollen, and pollinate many of the plants we eat."),
    ("caches", "A cache keeps recent results close at hand so repeated work is cheap."),
    ("glaciers", "Glaciers are slow rivers of ice that grind valleys into deep U shapes."),
    ("checksums", "A checksum is a short digest that changes when the data it covers changes."),
    ("volcanoes", "Volcanoes vent molten rock, ash and gas from deep inside the planet."),
    ("trains", "Trains run on rails, which keep rolling friction low over long distances."),
    ("gradients", "A gradient points in the direction in which a function grows fastest."),
    ("tea", "Tea leaves are withered, rolled, oxidised to taste, and dried."),
]
_QUESTIONS = [
    "Can you explain {t} in one or two sentences?",
    "What should a beginner know about {t}?",
    "Why do people find {t} interesting?",
    "Give me a short fact about {t}.",
    "How would you describe {t} to a child?",
]
_FOLLOW_UPS = [
    "Thanks. Can you say that more simply?",
    "Interesting. What is a common misconception?",
    "And how does that matter in daily life?",
]
_EXTRAS = [
    "In short, it is simpler than it first looks.",
    "Many people learn this at school and forget it later.",
    "The details vary, but the main idea holds.",
    "It is a good example of a simple rule with large effects.",
]
_SYSTEM = "You are a concise, friendly assistant."


# Sentences an answer of chat length is drawn from (about 12 tokens each).
_SENTENCES = [fact for _, fact in _TOPICS] + _EXTRAS


def _long_answer(rng: random.Random) -> str:
    """An answer of log-normally many sentences: median 24 (about 300 tokens), in [2, 160]."""
    count = min(max(round(rng.lognormvariate(math.log(24), 0.8)), 2), 160)
    return " ".join(rng.choice(_SENTENCES) for _ in range(count))


def generate_conversations(
    count: int, seed: int = 0, chat_lengths: bool = False
) -> Iterator[dict[str, Any]]:
    """Yield ``count`` conversations: 1-3 user/assistant exchanges, some with a system turn;
    answers of one to four sentences, or of chat length (``_long_answer``)."""
    rng = random.Random(seed)
    for index in range(count):
        topic, fact = _TOPICS[rng.randrange(len(_TOPICS))]
        messages: list[dict[str, str]] = []
        if rng.random() < 0.4:
            messages.append({"role": "system", "content": _SYSTEM})
        messages.append({"role": "user", "content": rng.choice(_QUESTIONS).format(t=topic)})
        if chat_lengths:
            answer = fact + " " + _long_answer(rng)
        else:
            answer = fact + " " + " ".join(rng.sample(_EXTRAS, k=rng.randint(0, 3)))
        messages.append({"role": "assistant", "content": answer.strip()})
        for _ in range(rng.choice([0, 0, 1, 2])):
            messages.append({"role": "user", "content": rng.choice(_FOLLOW_UPS)})
            if chat_lengths:
                reply = _long_answer(rng)
            else:
                reply = " ".join(rng.sample(_EXTRAS, k=rng.randint(1, 3)))
            messages.append({"role": "assistant", "content": reply})
        yield {"id": f"sample-{seed}-{index:06d}", "messages": messages}


def write_jsonl(path: Path, count: int, seed: int = 0, chat_lengths: bool = False) -> Path:
    """Write ``count`` generated conversations to ``path`` (one JSON object per line)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as out:
        for conversation in generate_conversations(count, seed, chat_lengths):
            out.write(json.dumps(conversation, ensure_ascii=False) + "\n")
    return path


if __name__ == "__main__":
    target = Path(sys.argv[1]) if len(sys.argv) > 1 else Path("data/sample_conversations.jsonl")
    number = int(sys.argv[2]) if len(sys.argv) > 2 else 300
    print(write_jsonl(target, number))
