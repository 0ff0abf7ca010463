"""What every front end does with the engine: the core that the Trainer's ZeroStrategy, Fabric's
ZeroFabricStrategy and DeepSpeed's ``initialize`` share. No Lightning here.

[Note: front ends]
A front end is the API a user trains through; the engine (zero_strategy/engine) is the same under
each. A front end owns only what its API asks for (Lightning's hooks and launchers, Fabric's
wrappers, DeepSpeed's batch arithmetic and engine object) and takes everything else from here:

- ``precision.py``: ``WorkingPrecision``, the working dtype, the fp32 masters and the fp16 loss
  scaler, one object whatever the front end (see [Note: precision]);
- ``setup.py``: ``setup_engine``, the one ordered function that puts a module and its optimizers
  on the engine (see [Note: the order of setup]), ``add_optimizers`` for optimizers that come
  later, and clipping through the engine; the result, an ``EngineModel``, is what the rest takes;
- ``checkpoint.py``: saving the sharded checkpoint and loading it, a regular file or a DeepSpeed
  directory into any world size and stage, masters included (see [Note: one checkpoint format for
  every front end]); ``named_state.py`` the same for a dict of named objects, the form Fabric's
  ``fabric.save(path, state)`` takes (see [Note: named state]);
- ``options.py``: the options the Lightning front ends share (checked once) and their process group;
- ``pretrained.py``: ``save_pretrained``, the Hugging Face export of a running job, and the guard on
  transformers' own ``save_pretrained`` at stage 3.

A third front end plugs in the same way: build a ``WorkingPrecision`` from its precision setting,
call ``setup_engine`` where its API receives the model (and optimizers), call the optimizers'
``step``/``zero_grad`` and ``clip_grad_norm`` where its loop does, and save and load through
``checkpoint.py``, putting its own state in the dict that ``save_sharded_model`` writes for rank 0.
"""

from .checkpoint import (check_safe_to_load, deepspeed_client_state, deepspeed_optimizer_state, load_full_model,
                         load_full_optimizers, load_sharded_model, load_sharded_optimizers, open_sharded,
                         read_deepspeed, read_file, read_state_dict_file, save_sharded_model)
from .precision import STATE_KEY, SUPPORTED_PRECISION, WorkingPrecision
from .setup import EngineModel, add_optimizers, clip_grad_norm, clip_grad_value, move_module, setup_engine, sync_module

__all__ = ["EngineModel", "STATE_KEY", "SUPPORTED_PRECISION", "WorkingPrecision", "add_optimizers",
           "check_safe_to_load", "clip_grad_norm", "clip_grad_value", "deepspeed_client_state",
           "deepspeed_optimizer_state", "load_full_model", "load_full_optimizers", "load_sharded_model",
           "load_sharded_optimizers", "move_module", "open_sharded", "read_deepspeed", "read_file",
           "read_state_dict_file", "save_sharded_model", "setup_engine", "sync_module"]
