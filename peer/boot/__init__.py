"""The peer's start-up, in the order ``peer.cli.run`` takes it: ``join`` (keys, the run, the
spec it computes with), ``plan`` (device, local ranks, task, swarm) and ``network`` (how others
reach it, its relay, puncher and coordinator link)."""
