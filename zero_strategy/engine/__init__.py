"""The ZeRO engine: plain torch + torch.distributed, no Lightning.

Usable on its own in a torch.distributed loop::

    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=2))
    loss.backward(); opt.step(); opt.zero_grad()
"""

from .collectives import Collectives
from .optimizer import ELEMENTWISE_OPTIMIZERS, ZeroOptimizer, check_optimizer_supported
from .parameters import FlatParameters, ParameterSharder, shard_module
from .scaler import LossScaler

__all__ = ["Collectives", "ELEMENTWISE_OPTIMIZERS", "FlatParameters", "LossScaler", "ParameterSharder", "ZeroOptimizer", "check_optimizer_supported",
           "shard_module"]
