"""The one harness the test suite and ``hicached bench`` share: real processes on loopback.

* :mod:`hicached.testing.procs`: free ports, installed executables, readiness polls with a
  deadline, stopping a process group by pid, a child's environment.
* :mod:`hicached.testing.servers`: ``redis-server``, SeaweedFS (``weed server -s3``) and
  ``mooncake_master`` (plus a segment host) as context managers.
* :mod:`hicached.testing.daemon`: ``python -m hicached serve`` as a subprocess, ready when
  the gRPC health service reports SERVING.

It ships in the package because the benchmarks do; the tests import it as
``hicached.testing``. Nothing here is imported by the daemon itself.
"""
