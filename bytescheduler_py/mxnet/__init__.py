"""MXNet support: :mod:`bytescheduler.mxnet.launch` starts a parameter-server job on one machine.

Nothing here imports MXNet; the launcher only starts processes that do.
"""
