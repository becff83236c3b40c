"""What the ``hsx`` commands share: the console they print on, how a bad value ends a command
(``fail``), settings built from CLI values over HSX_ variables, and ``--layer-ids`` parsing."""

from __future__ import annotations

from typing import Any

import typer
from rich.console import Console

console = Console(stderr=False)


def fail(message: str, code: int = 2) -> None:
    from rich.markup import escape

    # Escaped: messages quote values like [2, 4, 8] that rich would read as markup.
    console.print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True, highlight=False)
    raise typer.Exit(code)


def settings_errors(exc: Any) -> str:
    """A pydantic ValidationError as one line per bad setting: where, what, the value given."""
    lines = []
    for error in exc.errors():
        where = ".".join(str(part) for part in error["loc"]) or "settings"
        message = str(error["msg"]).removeprefix("Value error, ")
        lines.append(f"  {where}: {message}")
    return "\n".join(lines)


def parse_layer_ids(value: str | None) -> list[int] | None:
    if value is None:
        return None
    try:
        return [int(part) for part in value.replace(" ", "").split(",") if part]
    except ValueError:
        fail(f"--layer-ids: expected comma-separated integers like 2,16,29,32, found {value!r}")
    return None


def build_settings(**fields: Any) -> Any:
    """Extraction's settings from CLI values over HSX_ environment variables over defaults."""
    from settings import HsxSettings

    return build_settings_of(HsxSettings, **fields)


def build_settings_of(settings_class: Any, /, **fields: Any) -> Any:
    """Settings of ``settings_class`` (HsxSettings, RegenerateSettings) from CLI values (``section.key``
    for a section's) over HSX_ environment variables over defaults."""
    from pydantic import ValidationError

    sections: dict[str, dict[str, Any]] = {}
    top: dict[str, Any] = {}
    for key, value in fields.items():
        if value is None:
            continue
        if "." in key:
            section, name = key.split(".", 1)
            sections.setdefault(section, {})[name] = value
        else:
            top[key] = value
    try:
        # One validation of everything together: pydantic-settings deep-merges these values over
        # HSX_* variables (a cross-field check must see the CLI's values, not the defaults).
        return settings_class(**top, **sections)
    except ValidationError as exc:
        fail(f"invalid settings:\n{settings_errors(exc)}")
