"""The daemon's operations on plain Python types (no gRPC).

``service.HiCacheCore`` is what the gRPC servicer calls; it composes the L2
pool groups, the copy engine, the content index and the sessions.
"""
