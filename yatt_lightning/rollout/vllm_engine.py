"""Where configs written before ``engines/`` name the engine (``class_path:
yatt_lightning.rollout.vllm_engine.VLLMEngine``): the same class, from :mod:`yatt_lightning.engines`."""

from yatt_lightning.engines.vllm_engine import VLLMEngine

__all__ = ["VLLMEngine"]
