"""Predict data-parallel training on clusters this machine does not have.

* :mod:`~bytescheduler.sim.profile`: what one rank computes: per layer, the forward time
  and each gradient's size and moment in backward; measured from a bench model here, or
  loaded from JSON.
* :mod:`~bytescheduler.sim.network`: a link's rate and latency, and the cost of one
  all-reduce on N ranks (ring or tree).
* :mod:`~bytescheduler.sim.engine`: a discrete-event simulation of training iterations for
  DDP, DDP + scheduled hook and ScheduledOptimizer; the scheduled systems run the real
  :class:`~bytescheduler.core.policy.SchedulingPolicy` with simulated time.
* :mod:`~bytescheduler.sim.paper`: the ByteScheduler paper's models on a V100, built in.
* :mod:`~bytescheduler.sim.inputs`: the profile and network options every command takes.
* :mod:`~bytescheduler.sim.cli`: ``bytescheduler simulate``.
* :mod:`~bytescheduler.sim.planner`: ``bytescheduler plan`` (the runtime reads its plans:
  :mod:`bytescheduler.core.plan`).
* :mod:`~bytescheduler.sim.sweep`: ``bytescheduler sweep``, with a plot.

Imports no framework except where a profile is measured (torch).
"""
