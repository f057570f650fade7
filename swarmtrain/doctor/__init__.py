"""``swarmtrain doctor``: is this machine useful for a run, and if not, what to do about it.

``verdict`` (one line per check, or JSON), ``machine`` (this host: libraries, accelerator,
memory, /dev/shm, open files, a loopback DHT, measured speed), ``remote`` (the run's
coordinator: versions, spec digest, clock, the DHT's bootstrap peers, a dial-back, bandwidth).
"""
