from yatt_lightning.callbacks.dp_balance import DPLoadBalancer

__all__ = ["DPLoadBalancer"]
