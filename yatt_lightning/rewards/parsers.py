"""Reading a score out of a judge model's text. A parser returns ``None`` when it cannot read one."""

from __future__ import annotations

import json
import re


class ScoreParser:
    """Base class: ``__call__(text) -> float | None``."""

    def __call__(self, text: str) -> float | None:
        raise NotImplementedError


class NumberParser(ScoreParser):
    """The first number in the text, accepted if within [low, high], then scaled to [0, 1] if ``normalize``.

    Args:
        low: Smallest valid score.
        high: Largest valid score.
        normalize: Map [low, high] onto [0, 1].
    """

    _NUMBER = re.compile(r"-?\d+(?:\.\d+)?")

    def __init__(self, low: float = 0.0, high: float = 10.0, normalize: bool = True) -> None:
        if high <= low:
            raise ValueError(f"NumberParser: `high` ({high}) must be greater than `low` ({low}).")
        self.low, self.high, self.normalize = low, high, normalize

    def __call__(self, text: str) -> float | None:
        m = self._NUMBER.search(text)
        if m is None:
            return None
        value = float(m.group(0))
        if not self.low <= value <= self.high:
            return None
        return (value - self.low) / (self.high - self.low) if self.normalize else value


class RegexParser(ScoreParser):
    """A regular expression whose group holds the score, or a mapping from matched words to scores.

    Args:
        pattern: Regular expression searched in the text (``re.search``).
        group: The group holding the number (ignored when ``mapping`` is given).
        mapping: Scores for the matched group's text, e.g. ``{"yes": 1, "no": 0}``.
    """

    def __init__(self, pattern: str, group: int = 1, mapping: dict[str, float] | None = None) -> None:
        try:
            self.regex = re.compile(pattern)
        except re.error as err:
            raise ValueError(f"RegexParser: `pattern` {pattern!r} is not a valid regular expression ({err}).") from err
        if self.regex.groups and not 0 <= group <= self.regex.groups:
            raise ValueError(
                f"RegexParser: `group` {group} does not exist in {pattern!r}, which has {self.regex.groups} group(s)."
            )
        self.group = group
        self.mapping = mapping

    def __call__(self, text: str) -> float | None:
        m = self.regex.search(text)
        if m is None:
            return None
        found = m.group(self.group if self.regex.groups else 0)
        if self.mapping is not None:
            return self.mapping.get(found.strip().lower())
        try:
            return float(found)
        except ValueError:
            return None


class JsonParser(ScoreParser):
    """A JSON object in the text (the first ``{...}``) and the number under ``key``.

    Args:
        key: The field holding the score.
    """

    def __init__(self, key: str = "score") -> None:
        self.key = key

    def __call__(self, text: str) -> float | None:
        start, end = text.find("{"), text.rfind("}")
        if start < 0 or end <= start:
            return None
        try:
            value = json.loads(text[start : end + 1]).get(self.key)
            return float(value)
        except (json.JSONDecodeError, AttributeError, TypeError, ValueError):
            return None
