"""Typed, validated runtime settings shared by the caches, the settings node and the web panel.

A cache defines its settings once (``SETTINGS.define(...)``) with a type, a range and a callback
that applies a new value at once (no restart). ``set`` validates before anything changes and
raises ``ValueError`` with a message that names the setting; ``update`` applies several settings
all or nothing. A setting may be ``env_only`` (where a value points the pack at a folder or a server:
no client of ComfyUI's API may change it), may map values of an older form of itself (``legacy``,
one log line), and may be shown otherwise than it is (``shown``: a URL without its password).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("reusekit")


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
    env_only: str | None = None  # the environment variable that alone sets it
    legacy: Callable[[Any], Any] | None = None  # an older form's value -> today's (None: not an older form)
    shown: Callable[[Any], Any] | None = None
    value: Any = field(default=None)

    def validate(self, raw: Any) -> Any:
        name = f"setting {self.key!r}"
        if self.legacy is not None:
            mapped = self.legacy(raw)
            if mapped is not None:
                log.info("ReuseKit: %s: %s is an older form of %s", name, _shown(raw), _shown(mapped))
                raw = mapped
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
        show = self.shown or (lambda v: v)
        return {"value": show(self.value), "default": show(self.default), "type": self.kind.__name__,
                "min": self.minimum, "max": self.maximum,
                "choices": list(self.choices) if self.choices else None, "description": self.description,
                "readonly": self.env_only is not None, "env": self.env_only}


class SettingsRegistry:
    def __init__(self) -> None:
        self._lock = threading.RLock()  # the settings and their values: held for a read or an assignment only
        self._applying = threading.RLock()  # one update at a time, through its callbacks
        self._settings: dict[str, Setting] = {}

    def define(self, key: str, kind: type, default: Any, description: str = "", *,
               minimum: float | None = None, maximum: float | None = None, choices: tuple | None = None,
               on_change: Callable[[Any], None] | None = None, env_only: str | None = None,
               legacy: Callable[[Any], Any] | None = None, shown: Callable[[Any], Any] | None = None) -> Setting:
        """Define a setting (its value starts at ``default``); defining a key twice is an error.
        ``env_only``: the environment variable that alone sets it (``set`` refuses, naming it)."""
        setting = Setting(key, kind, default, description, minimum, maximum, choices, on_change, env_only, legacy,
                          shown)
        setting.value = setting.validate(default)
        with self._lock:
            if key in self._settings:
                raise KeyError(f"setting {key!r} is already defined")
            self._settings[key] = setting
        return setting

    def get(self, key: str) -> Any:
        with self._lock:
            return self._lookup(key).value

    def set(self, key: str, raw: Any, *, trusted: bool = False) -> Any:
        return self.update({key: raw}, trusted=trusted)[key]

    def update(self, values: dict[str, Any], *, trusted: bool = False) -> dict[str, Any]:
        """Validate every value first, then apply them in order; nothing changes if one is bad,
        and a callback that raises undoes the settings already applied (ValueError naming the
        setting, whatever the callback raised: a folder it cannot read...). ``trusted``: the pack's
        own code in this process (tests, the bench) may change ``env_only`` settings; the routes
        and nodes never pass it. Callbacks run outside the values' lock: a reader (a sampling thread) never
        waits on one (a Redis server reconnecting); it sees a new value from the moment it is assigned."""
        with self._applying:
            for key in values:
                env = self._lookup(key).env_only
                if env is not None and not trusted:
                    raise ValueError(f"setting {key!r} is set from the environment only ({env}), "
                                     "never through ComfyUI's API")
            validated = {key: self._lookup(key).validate(raw) for key, raw in values.items()}
            applied: list[tuple[Setting, Any]] = []
            try:
                for key, value in validated.items():
                    setting = self._settings[key]
                    if value != setting.value:
                        with self._lock:
                            previous, setting.value = setting.value, value
                        try:
                            if setting.on_change is not None:
                                setting.on_change(value)
                        except Exception as exc:
                            with self._lock:
                                setting.value = previous  # this cache refused the value
                            if isinstance(exc, ValueError):
                                raise
                            said = str(exc) if len(str(exc)) <= 160 else str(exc)[:160] + "..."
                            raise ValueError(f"setting {key!r} could not be applied: {type(exc).__name__}: "
                                             f"{said}") from exc
                        applied.append((setting, previous))
            except Exception:
                for setting, previous in reversed(applied):  # put back what was already applied
                    with self._lock:
                        setting.value = previous
                    if setting.on_change is not None:
                        try:
                            setting.on_change(previous)
                        except Exception:  # the others are still put back
                            log.exception("ReuseKit: setting %r could not be put back to %s", setting.key,
                                          _shown(previous))
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


def label(key: str) -> str:
    """A setting as the panel's settings list names it."""
    return key.replace("_", " ").replace(".", " ")
