"""The training node, in rooms that spell a round's life: ``round`` (the trainer, its loop, host
passes, state), ``swarm`` (DHT and averager behind the round's port), ``net`` (how others reach
it), ``link`` (its coordinator), ``node`` (the machine: ranks, inner steps), ``task`` (model and
data); ``cli`` starts them and ``export`` writes a state as a model. Imports ``engine`` and
``protocol``, never ``coordinator``."""
