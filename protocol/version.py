"""The software version every role reports (peers send it at admission; ``swarmtrain --version``)."""

__version__ = "0.1.0"
