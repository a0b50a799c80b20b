from yatt_lightning.callbacks.async_checkpoint import AsyncCheckpoint
from yatt_lightning.callbacks.dp_balance import DPLoadBalancer

__all__ = ["AsyncCheckpoint", "DPLoadBalancer"]
