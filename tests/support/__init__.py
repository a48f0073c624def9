"""Test-only helpers, imported one way (``from tests.support.X import ...``).

The daemon and real-server launchers themselves live in :mod:`hicached.testing` (shared with
``hicached bench``); this package holds what only tests need: ``daemon.start_daemon`` with the
suite's defaults, ``kv`` (KV buffers and page keys), ``state`` (what a daemon holds),
``workers``/``worker_kv`` (scenarios run as real worker processes).
"""
