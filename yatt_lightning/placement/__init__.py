"""Placement: which ranks run the rollout engine and the generative reward model (GenRM), and in what order.

:class:`FullColocation` (``full.py``) runs the stages in series on every rank; :class:`PartialColocation`
(``partial.py``) puts the policy's engine on the rollout ranks and the judge on the judge ranks at the
same time, streaming finished groups between them (``rollout_side.py``, ``judge_side.py``, with
the typed messages of ``stream.py`` and the roles of ``pairing.py``). :class:`Disaggregated` (``disaggregated.py``) puts engines and
rewards on rollout ranks and training on the others, a bounded number of policy versions apart
(asynchronous RL; its channels: ``batch_channel.py``, ``weight_channel.py``). The colocated ones log, per step, each rank's idle time in the rollout + reward
phase (``idle/rank<r>``, ``idle_fraction/rank<r>``).
"""

from yatt_lightning.placement.base import Placement
from yatt_lightning.placement.disaggregated import Disaggregated
from yatt_lightning.placement.full import FullColocation
from yatt_lightning.placement.partial import PartialColocation

__all__ = ["Disaggregated", "FullColocation", "PartialColocation", "Placement"]
