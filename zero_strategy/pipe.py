"""``zero_strategy.pipe``, as ``deepspeed.pipe``: not supported; ``PipelineModule``, ``LayerSpec`` and
the rest raise when used (see zero_strategy/deepspeed/unsupported.py)."""

from .deepspeed.unsupported import PIPE, module_getattr, refusing

PipelineModule = refusing("deepspeed.pipe.PipelineModule", PIPE)
LayerSpec = refusing("deepspeed.pipe.LayerSpec", PIPE)
TiedLayerSpec = refusing("deepspeed.pipe.TiedLayerSpec", PIPE)
ProcessTopology = refusing("deepspeed.pipe.ProcessTopology", PIPE)
__getattr__ = module_getattr("deepspeed.pipe", PIPE)
