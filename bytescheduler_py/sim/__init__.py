"""Predict data-parallel training on clusters this machine does not have.

* :mod:`~bytescheduler.sim.profile`: what one rank computes (per layer, the forward time
  and each gradient's size and moment in backward); measured from a bench model here, or
  loaded from JSON; :mod:`~bytescheduler.sim.trace` builds one from a recorded run.
* :mod:`~bytescheduler.sim.network`: a link's rate and latency, the cost of one all-reduce
  on N ranks (ring or tree), where the parameter servers live.
* :mod:`~bytescheduler.sim.fluid`, :mod:`~bytescheduler.sim.events`: the discrete-event
  core: timers, threads, and a rank's core(s) and links shared max-min fair.
* :mod:`~bytescheduler.sim.training`: the training thread (forward, backward, step).
* :mod:`~bytescheduler.sim.allreduce`, :mod:`~bytescheduler.sim.horovod`,
  :mod:`~bytescheduler.sim.ps`: each system's mechanics (gloo and DDP, Horovod's cycle and
  fusion, MXNet's parameter server); :mod:`~bytescheduler.sim.scheduling` drives the real
  :class:`~bytescheduler.core.policy.SchedulingPolicy` with simulated time.
* :mod:`~bytescheduler.sim.engine`: :func:`~bytescheduler.sim.engine.simulate`, the systems.
* :mod:`~bytescheduler.sim.calibration`, :mod:`~bytescheduler.sim.calibrate` (with
  :mod:`~bytescheduler.sim.probe_torch`, :mod:`~bytescheduler.sim.probe_mxnet`,
  :mod:`~bytescheduler.sim.usage`): ``bytescheduler calibrate``, what each backend costs here.
* :mod:`~bytescheduler.sim.gantt`: the simulated iterations as the bench's timeline picture.
* :mod:`~bytescheduler.sim.validate`: predictions beside ``bytescheduler bench``'s measurements.
* :mod:`~bytescheduler.sim.paper`: the ByteScheduler paper's models on a V100, built in.
* :mod:`~bytescheduler.sim.inputs`: the profile and network options every command takes.
* :mod:`~bytescheduler.sim.cli`: ``bytescheduler simulate``.
* :mod:`~bytescheduler.sim.planner`: ``bytescheduler plan`` (the runtime reads its plans:
  :mod:`bytescheduler.core.plan`).
* :mod:`~bytescheduler.sim.sweep`: ``bytescheduler sweep``, with a plot.
* :mod:`~bytescheduler.sim.choosing`: what the mode switch's trials and re-trials cost over a
  training of N steps (the real chooser fed synthetic step times).

Imports no framework except where a profile is measured (torch) or a backend probed.
"""
