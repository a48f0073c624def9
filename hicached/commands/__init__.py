"""Subcommands of the ``hicached`` CLI, one module each (see ``hicached.cli``)."""
