"""Error messages shared by the CLI and the configuration readers (no heavy imports: ``rkit
--help`` loads this)."""

from __future__ import annotations

from typing import Any


def validation_error_text(exc: Any) -> str:
    """A pydantic ``ValidationError`` in one line: the model, then each field, its problem and the
    value (not pydantic's several lines and help links). Any other exception: ``str(exc)``."""
    errors = getattr(exc, "errors", None)
    if not callable(errors) or not hasattr(exc, "title"):
        return str(exc)
    parts = []
    for err in errors():
        where = ".".join(str(p) for p in err.get("loc", ()))
        msg = str(err.get("msg", "")).removeprefix("Value error, ")
        if err.get("type") != "value_error" and "input" in err:
            msg += f", got {err['input']!r}"
        parts.append(f"{where}: {msg}" if where else msg)
    return f"{exc.title}: " + "; ".join(parts)
