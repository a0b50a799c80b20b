"""Installs yatt_lightning's image-processor shim in subprocesses (vLLM's model inspection); see vision_shim."""

from yatt_lightning.multimodal import vision_shim

vision_shim.install()
