"""Settings as strict as data: an unknown key anywhere (a misspelt HSX_ variable, a typo in a
deployment's parameters) fails naming the key and the closest known one, instead of being
silently ignored while the run uses the default."""

from __future__ import annotations

import difflib
from collections.abc import Mapping
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict, model_validator


def unknown_keys_message(section: str, given: dict[str, Any], known: list[str]) -> str | None:
    """None when every key of ``given`` is known, else a message naming each unknown key with
    the closest known one (and the environment variable it would come from)."""
    unknown = [key for key in given if key not in known]
    if not unknown:
        return None
    parts = []
    for key in unknown:
        where = f"{section}.{key}" if section else key
        env = "HSX_" + where.replace(".", "__").upper()
        close = difflib.get_close_matches(key, known, n=1, cutoff=0.6)
        hint = (
            f"did you mean {section + '.' if section else ''}{close[0]}?"
            if close
            else f"expected one of {', '.join(sorted(known))}"
        )
        parts.append(f"unknown setting {where!r} (env {env}): {hint}")
    return "; ".join(parts)


class StrictSection(BaseModel):
    """A settings section that refuses unknown keys with the closest known name."""

    model_config = ConfigDict(extra="forbid")
    SECTION: ClassVar[str] = ""  # the section's key in HsxSettings, for messages

    @model_validator(mode="before")
    @classmethod
    def _known_keys_only(cls, data: Any) -> Any:
        if isinstance(data, dict):
            message = unknown_keys_message(
                cls._section_name(), data, list(cls.model_fields) + _aliases(cls)
            )
            if message is not None:
                raise ValueError(message)
        return data

    @classmethod
    def _section_name(cls) -> str:
        return cls.SECTION


def _aliases(model: type[BaseModel]) -> list[str]:
    return [info.alias for info in model.model_fields.values() if info.alias]


# HSX_ variables that are not settings: read by scripts/bootstrap.sh and flows/allocator.py.
NOT_SETTINGS = frozenset(
    {
        "HSX_VLLM",
        "HSX_SKIP_BOOTSTRAP",  # a provided .venv, used as it is (scripts/bootstrap.sh)
        "HSX_ALLOCATOR",
        "HSX_REEXECUTED",
        "HSX_REPO",  # the checkout a worker runs flows from (infra/start-worker.sh)
        "HSX_PREFECT_HOME",  # infra/prefect-up.sh's state folder
        "HSX_WORKER_LIMIT",  # flow runs at once per worker (infra/start-worker.sh)
        "HSX_WORKER_POOL",  # the pool a worker serves (infra/start-worker.sh)
        "HSX_WORKER_STOP_GRACE_S",  # a stopping worker's wait for its runs (flows/worker_launch.py)
        "HSX_ZOMBIE_WINDOW_S",  # silence before a run is marked Crashed (infra/prefect-up.sh)
    }
)


def unknown_environment(
    environ: Mapping[str, str],
    sections: Mapping[str, list[str]],
    top: list[str],
    elsewhere: frozenset[str] = frozenset(),
) -> str | None:
    """A message naming each ``HSX_`` variable that sets nothing (pydantic-settings ignores
    those whose first part is no field), with the closest known variable; None when all are known.
    ``sections``: section -> its fields; ``top``: the fields that are not sections;
    ``elsewhere``: the first parts that another entry point's settings read (one environment
    file serves `hsx serve` and `hsx extract`), passed over here."""
    known = [f"HSX_{name.upper()}" for name in top] + [
        f"HSX_{section.upper()}__{field.upper()}"
        for section, fields in sections.items()
        for field in fields
    ]
    problems = []
    for name in sorted(environ):
        upper = name.upper()
        if not upper.startswith("HSX_") or upper in NOT_SETTINGS:
            continue
        head = upper.removeprefix("HSX_").split("__", 1)[0].lower()
        if head in sections or head in top or head in elsewhere:
            continue  # a section's own keys are checked by the section
        problems.append(f"unknown setting variable {name}: {_variable_hint(upper, known)}")
    return "; ".join(problems) or None


def _variable_hint(upper: str, known: list[str]) -> str:
    """The closest known variable: first those whose field is the name given without its
    section (HSX_DTYPE -> HSX_ENGINE__DTYPE), then the closest spelling of the whole name."""
    tail = upper.removeprefix("HSX_").rsplit("__", 1)[-1]
    same_field = [name for name in known if name.rsplit("__", 1)[-1] == f"{tail}" and "__" in name]
    if same_field:
        return f"did you mean {' or '.join(same_field)}?"
    by_field = difflib.get_close_matches(
        tail, [name.rsplit("__", 1)[-1] for name in known if "__" in name], n=1, cutoff=0.75
    )
    close = [name for name in known if by_field and name.endswith(f"__{by_field[0]}")]
    close = close or difflib.get_close_matches(upper, known, n=1, cutoff=0.6)
    return f"did you mean {' or '.join(close)}?" if close else f"expected one of {', '.join(known)}"


def refuse_unknown_keys(
    model: type[BaseModel], data: Any, elsewhere: frozenset[str] = frozenset()
) -> Any:
    """A settings model's check before validation: every key of ``data`` and every ``HSX_``
    variable is one of its fields (or, ``elsewhere``, of another entry point's sections).
    Raises ValueError naming each unknown one with the closest known; returns ``data``."""
    import os

    if isinstance(data, dict):
        message = unknown_keys_message("", data, list(model.model_fields))
        if message is not None:
            raise ValueError(message)
    sections = {
        name: list(info.annotation.model_fields)
        for name, info in model.model_fields.items()
        if isinstance(info.annotation, type) and issubclass(info.annotation, StrictSection)
    }
    top = [name for name in model.model_fields if name not in sections]
    message = unknown_environment(os.environ, sections, top, elsewhere)
    if message is not None:
        raise ValueError(message)
    return data
