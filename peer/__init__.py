"""The training node: task and model, data shards, inner loop, outer step, averaging,
checkpoints, metrics and its CLI. Imports ``protocol``, never ``coordinator``."""
