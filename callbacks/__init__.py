from yatt_lightning.callbacks.async_checkpoint import AsyncCheckpoint
from yatt_lightning.callbacks.dp_balance import DPLoadBalancer
from yatt_lightning.callbacks.run_console import RunConsole
from yatt_lightning.callbacks.step_logger import StepLogger

__all__ = ["AsyncCheckpoint", "DPLoadBalancer", "RunConsole", "StepLogger"]
