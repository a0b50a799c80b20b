"""The model families by Hugging Face ``model_type``: one registration each, a second refused."""

from __future__ import annotations

from functools import lru_cache

_FAMILIES: dict[str, object] = {}


def register(family_class):
    """Class decorator: register one instance of ``family_class`` under its ``model_type``."""
    model_type = family_class.model_type
    if not model_type:
        raise ValueError(f"{family_class.__name__} has no model_type")
    if model_type in _FAMILIES:
        raise ValueError(
            f"model type {model_type!r} is registered twice: {type(_FAMILIES[model_type]).__name__} and "
            f"{family_class.__name__}"
        )
    _FAMILIES[model_type] = family_class()
    return family_class


def registered() -> tuple[str, ...]:
    return tuple(_FAMILIES)


def family_for(cfg):
    """The family of a Hugging Face config (its ``model_type``), or an error naming the supported ones."""
    return family_named(cfg.model_type)


def arch_of(cfg):
    """The :class:`~yatt_lightning.models.families.arch.HFArch` of a Hugging Face config, read by its family; for a
    vision-language model (LLaVA), its language model's."""
    return family_for(cfg).arch(cfg)


def family_named(model_type: str):
    if model_type not in _FAMILIES:
        raise ValueError(
            f"`model.policy.path`: model type {model_type!r} is not supported; supported: {', '.join(_FAMILIES)}."
        )
    return _FAMILIES[model_type]


@lru_cache(maxsize=64)
def weight_table(arch):
    """The weight table of ``arch`` (an :class:`~yatt_lightning.models.families.arch.HFArch`, hashable), built once."""
    return family_named(arch.model_type).weight_table(arch)
