"""The inference engines: what an engine takes and gives back (``base.py``: sampling settings, completions and
their turns, the :class:`~yatt_lightning.engines.base.RolloutEngine` protocol) and vLLM behind it (``vllm_*.py``:
the engine, its groups, model-name mapping, outputs, text, shutdown; ``worker_extension.py``, which runs inside
vLLM's worker; the KV-cache size and the engine step's deadline). Above: ``rollout/`` orchestrates them (the
service, the controllers, long-tail policies), ``rewards/genrm.py`` runs a judge on one.
"""
