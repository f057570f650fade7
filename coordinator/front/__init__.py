"""Heartbeats served by processes of their own (``process``), fed and drained by the core's
side (``link``): a coordinator of thousands of peers spends most of its interpreter on
heartbeats' gRPC and signatures, which need none of its state but a table of answers."""
