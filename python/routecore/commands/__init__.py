"""Subcommands of the ``routecore`` command (see ``routecore.cli``)."""
