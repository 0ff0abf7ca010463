"""One file per step backend (see [Note: step backends] in engine/optim/step/backend.py): a new way
to step is a new backend here, chosen in ``choice.py``, never a new flag elsewhere.
"""
