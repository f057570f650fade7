"""One module per ``swarmtrain`` subcommand; each exposes ``add_parser`` and ``run``."""
