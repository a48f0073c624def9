"""Client library for the hicached daemon (wire contract ``hicached.v1``)."""

__version__ = "0.1.0"
