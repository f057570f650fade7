"""A round's life on the peer: the trainer and its loop, the host passes and the global state, the
roster it keeps, the timeouts it learns, the metrics row and progress line of each round, and
SwarmPort, all it needs of the swarm."""
