"""Typed, validated runtime settings shared by the caches, the settings node and the web panel.

A cache defines its settings once (``SETTINGS.define(...)``) with a type, a range and a callback
that applies a new value at once (no restart). ``set`` validates before anything changes and
raises ``ValueError`` with a message that names the setting; ``update`` applies several settings
all or nothing.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any


def _shown(raw: Any, limit: int = 80) -> str:
    """``repr(raw)``, cut to ``limit`` characters: an error message never echoes a huge input."""
    text = repr(raw)
    return text if len(text) <= limit else f"{text[:limit]}... ({len(text)} characters)"


@dataclass
class Setting:
    key: str
    kind: type  # bool, int, float or str
    default: Any
    description: str = ""
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple | None = None
    on_change: Callable[[Any], None] | None = None
    value: Any = field(default=None)

    def validate(self, raw: Any) -> Any:
        name = f"setting {self.key!r}"
        got = _shown(raw)
        if self.kind is bool:
            if not isinstance(raw, bool):
                raise ValueError(f"{name} must be true or false, got {got}")
            return raw
        if self.kind in (int, float):
            if isinstance(raw, bool) or not isinstance(raw, (int, float)):
                raise ValueError(f"{name} must be a number, got {got}")
            if raw != raw or raw in (float("inf"), float("-inf")):
                raise ValueError(f"{name} must be finite, got {got}")
            if self.kind is int and isinstance(raw, float) and not raw.is_integer():
                raise ValueError(f"{name} must be a whole number, got {got}")
            try:
                value = self.kind(raw)
            except OverflowError:  # an integer too large for a float
                raise ValueError(f"{name} is too large, got {got}") from None
            if self.minimum is not None and value < self.minimum:
                raise ValueError(f"{name} must be at least {self.minimum}, got {got}")
            if self.maximum is not None and value > self.maximum:
                raise ValueError(f"{name} must be at most {self.maximum}, got {got}")
            return value
        if not isinstance(raw, str):
            raise ValueError(f"{name} must be text, got {got}")
        if self.choices is not None and raw not in self.choices:
            raise ValueError(f"{name} must be one of {', '.join(map(str, self.choices))}, got {got}")
        return raw

    def describe(self) -> dict[str, Any]:
        return {"value": self.value, "default": self.default, "type": self.kind.__name__,
                "min": self.minimum, "max": self.maximum,
                "choices": list(self.choices) if self.choices else None, "description": self.description}


class SettingsRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._settings: dict[str, Setting] = {}

    def define(self, key: str, kind: type, default: Any, description: str = "", *,
               minimum: float | None = None, maximum: float | None = None, choices: tuple | None = None,
               on_change: Callable[[Any], None] | None = None) -> Setting:
        """Define a setting (its value starts at ``default``); defining a key twice is an error."""
        setting = Setting(key, kind, default, description, minimum, maximum, choices, on_change)
        setting.value = setting.validate(default)
        with self._lock:
            if key in self._settings:
                raise KeyError(f"setting {key!r} is already defined")
            self._settings[key] = setting
        return setting

    def get(self, key: str) -> Any:
        with self._lock:
            return self._lookup(key).value

    def set(self, key: str, raw: Any) -> Any:
        return self.update({key: raw})[key]

    def update(self, values: dict[str, Any]) -> dict[str, Any]:
        """Validate every value first, then apply them in order; nothing changes if one is bad,
        and a callback that raises undoes the settings already applied."""
        with self._lock:
            validated = {key: self._lookup(key).validate(raw) for key, raw in values.items()}
            applied: list[tuple[Setting, Any]] = []
            try:
                for key, value in validated.items():
                    setting = self._settings[key]
                    if value != setting.value:
                        previous, setting.value = setting.value, value
                        try:
                            if setting.on_change is not None:
                                setting.on_change(value)
                        except Exception:
                            setting.value = previous  # this cache refused the value
                            raise
                        applied.append((setting, previous))
            except Exception:
                for setting, previous in reversed(applied):  # put back what was already applied
                    setting.value = previous
                    if setting.on_change is not None:
                        setting.on_change(previous)
                raise
            return validated

    def snapshot(self) -> dict[str, dict[str, Any]]:
        with self._lock:
            return {key: s.describe() for key, s in self._settings.items()}

    def _lookup(self, key: str) -> Setting:
        try:
            return self._settings[key]
        except KeyError:
            raise ValueError(f"unknown setting {key!r}") from None


SETTINGS = SettingsRegistry()
"""The process-wide settings of the pack."""
