"""Parameters at stage 3 and at set-up: the unit plan, the units (each owns its gather and release),
the owner of a module's flat groups (``FlatParameters``), saved weights, deferred init and
materialisation.
"""
