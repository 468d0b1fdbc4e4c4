"""Predict data-parallel training on clusters this machine does not have.

* :mod:`~bytescheduler_tools.sim.profile`: what one rank computes (per layer, the forward time
  and each gradient's size and moment in backward); measured from a bench model here, or
  loaded from JSON; :mod:`~bytescheduler_tools.sim.trace` builds one from a recorded run.
* :mod:`~bytescheduler_tools.sim.network`: a link's rate and latency, the cost of one all-reduce
  on N ranks (ring or tree), where the parameter servers live.
* :mod:`~bytescheduler_tools.sim.fluid`, :mod:`~bytescheduler_tools.sim.events`: the discrete-event
  core: timers, threads, and a rank's core(s) and links shared max-min fair.
* :mod:`~bytescheduler_tools.sim.training`: the training thread (forward, backward, step).
* :mod:`~bytescheduler_tools.sim.allreduce`, :mod:`~bytescheduler_tools.sim.horovod`,
  :mod:`~bytescheduler_tools.sim.ps`: each system's mechanics (gloo and DDP, Horovod's cycle and
  fusion, MXNet's parameter server); :mod:`~bytescheduler_tools.sim.scheduling` drives the real
  :class:`~bytescheduler.core.policy.SchedulingPolicy` with simulated time.
* :mod:`~bytescheduler_tools.sim.engine`: :func:`~bytescheduler_tools.sim.engine.simulate`, the systems.
* :mod:`~bytescheduler_tools.sim.calibration`, :mod:`~bytescheduler_tools.sim.calibrate` (with
  :mod:`~bytescheduler_tools.sim.probe_torch`, :mod:`~bytescheduler_tools.sim.probe_mxnet`,
  :mod:`~bytescheduler_tools.sim.usage`): ``bytescheduler calibrate``, what each backend costs here.
* :mod:`~bytescheduler_tools.sim.gantt`: the simulated iterations as the bench's timeline picture.
* :mod:`~bytescheduler_tools.sim.validate`: predictions beside ``bytescheduler bench``'s measurements.
* :mod:`~bytescheduler_tools.sim.paper`: the ByteScheduler paper's models on a V100, built in.
* :mod:`~bytescheduler_tools.sim.inputs`: the profile and network options every command takes.
* :mod:`~bytescheduler_tools.sim.cli`: ``bytescheduler simulate``.
* :mod:`~bytescheduler_tools.sim.planner`: ``bytescheduler plan`` (the runtime reads its plans:
  :mod:`bytescheduler.core.plan`).
* :mod:`~bytescheduler_tools.sim.sweep`: ``bytescheduler sweep``, with a plot.
* :mod:`~bytescheduler_tools.sim.choosing`: what the mode switch's trials and re-trials cost over a
  training of N steps (the real chooser fed synthetic step times).

Imports no framework except where a profile is measured (torch) or a backend probed.
"""
