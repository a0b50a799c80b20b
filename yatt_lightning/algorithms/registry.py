"""Names of the algorithm classes, one class per name and family, so a YAML file or a log can name one.

Every subclass of an algorithm family (:class:`~yatt_lightning.algorithms.AdvantageEstimator`,
:class:`~yatt_lightning.algorithms.PolicyLoss`, ...) registers itself under ``name`` (default: the class
name) when its module is imported, so a user's estimator in the user's own file is an ordinary subclass
selected with ``class_path: my_module.MyEstimator``. Two classes of one family under one name are refused
at definition, naming both: a YAML file or a short ``class_path`` must never mean one of two classes
depending on import order. Redefining the same class (a module reloaded) replaces it.
"""

from __future__ import annotations

from typing import ClassVar


class Registered:
    """Base of an algorithm family: subclass it directly to start a family (``family = "..."``), and
    subclass a family's base to add an algorithm (``name`` defaults to the class name)."""

    family: ClassVar[str] = ""
    name: ClassVar[str] = ""
    _registry: ClassVar[dict[str, dict[str, type]]] = {}

    def __init_subclass__(cls, **kwargs) -> None:
        super().__init_subclass__(**kwargs)
        if Registered in cls.__bases__:  # a family's base class
            Registered._registry.setdefault(cls.family, {})
            return
        if "name" not in cls.__dict__:
            cls.name = cls.__name__
        known = Registered._registry[cls.family]
        other = known.get(cls.name)
        if other is not None and _path(other) != _path(cls):
            raise TypeError(
                f"two {cls.family} classes are named {cls.name!r}: {_path(other)} and {_path(cls)}; "
                f'rename one, or give it another name with a class attribute `name = "..."`.'
            )
        known[cls.name] = cls


def registered(family: str) -> dict[str, type]:
    """The classes of ``family`` by name, in the order they were defined."""
    return dict(Registered._registry.get(family, {}))


def _path(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"
