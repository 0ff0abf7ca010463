"""The ZeRO engine: plain torch + torch.distributed, no Lightning.

Usable on its own in a torch.distributed loop::

    opt = ZeroOptimizer(torch.optim.AdamW(model.parameters(), lr=1e-3), ZeroConfig(stage=2))
    loss.backward(); opt.step(); opt.zero_grad()
"""

from .comm.collectives import Collectives
from .grads.scaler import LossScaler
from .optim.optimizer import ELEMENTWISE_OPTIMIZERS, ZeroOptimizer, check_optimizer_supported
from .params.buffer_sync import BufferBroadcast
from .params.flat_parameters import FlatParameters, shard_module

__all__ = ["BufferBroadcast", "Collectives", "ELEMENTWISE_OPTIMIZERS", "FlatParameters", "LossScaler",
           "ZeroOptimizer", "check_optimizer_supported", "shard_module"]
