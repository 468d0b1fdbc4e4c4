"""What every simulator command (``simulate``, ``plan``, ``sweep``) takes: a profile and a network.

The profile: ``--model NAME`` (a bench model, profiled on this machine, or one of the
paper's models of :mod:`bytescheduler_tools.sim.paper`), ``--profile FILE`` (a JSON profile, e.g.
written by ``--save-profile``), ``--trace FILE...`` (a recorded run's Chrome trace:
:mod:`bytescheduler_tools.sim.trace`), ``--batch-size``, ``--compute-s`` (scaled to another
machine's speed). The network: ``--latency-us``, ``--op-us``, ``--algorithm`` and
``--servers``; each command takes its link rate(s) itself.

>>> load_profile("transformer-v100").model
'transformer-v100'
>>> parser = argparse.ArgumentParser()
>>> add_network_arguments(parser)
>>> network_from(parser.parse_args(["--algorithm", "tree"]), "10gbit").algorithm
'tree'
"""

from __future__ import annotations

import argparse
from typing import Optional

import os

from ..bench.models import MODELS as BENCH_MODELS
from .network import Network, parse_rate
from .paper import MODELS as PAPER_MODELS, paper_profile
from .profile import Profile, measure, scaled

MODEL_CHOICES = [*BENCH_MODELS, *PAPER_MODELS]


def add_profile_arguments(parser: argparse.ArgumentParser, default_model: str = "vgg") -> None:
    """The options that choose a profile (see the module docstring)."""
    parser.add_argument("--model", default=default_model, choices=MODEL_CHOICES,
                        help=f"bench model to profile here (default {default_model}), or a built-in paper-scale "
                        f"profile ({', '.join(PAPER_MODELS)})")
    parser.add_argument("--batch-size", type=int, default=32, help="per rank, for a bench model's profile (default 32)")
    parser.add_argument("--profile", help="read the profile from this JSON file instead")
    parser.add_argument("--trace", nargs="+", metavar="FILE",
                        help="build the profile from a recorded run's Chrome trace instead (a rank's timeline, "
                             "e.g. bench traces/scheduled.rank0.json; a bench compute.json may be added)")
    parser.add_argument("--compute-s", type=float, metavar="SECONDS",
                        help="scale the profile so that its compute-only iteration takes SECONDS (another "
                             "machine's speed, e.g. a bench run's compute row)")
    parser.add_argument("--save-profile", help="write the profile used to this JSON file")


def load_profile(model: str, profile_file: Optional[str] = None, batch_size: int = 32,
                 save: Optional[str] = None) -> Profile:
    """The profile of ``profile_file`` if given, else of ``model``: built in, or measured here."""
    if profile_file:
        with open(profile_file) as handle:
            profile = Profile.from_json(handle.read())
    elif model in PAPER_MODELS:
        profile = paper_profile(model)
    else:
        profile = measure(model, batch_size)
    if save:
        with open(save, "w") as handle:
            handle.write(profile.to_json())
    return profile


def profile_from(args: argparse.Namespace) -> Profile:
    """The profile the options of :func:`add_profile_arguments` choose (a ``ValueError``
    names a wrong one)."""
    if args.trace:
        from .trace import profile_from_trace

        if args.profile:
            raise ValueError("--profile and --trace both give the profile: give one")
        profile = profile_from_trace(args.trace, model=os.path.basename(args.trace[0]))
    else:
        profile = load_profile(args.model, args.profile, args.batch_size)
    if args.compute_s is not None:
        if not args.compute_s > 0:
            raise ValueError(f"--compute-s must be positive, not {args.compute_s}")
        profile = scaled(profile, args.compute_s / profile.compute_s)
    if args.save_profile:
        with open(args.save_profile, "w") as handle:
            handle.write(profile.to_json())
    return profile


def add_network_arguments(parser: argparse.ArgumentParser) -> None:
    """The options of the network besides its rate."""
    parser.add_argument("--latency-us", type=float, default=50.0, help="per message step (default 50)")
    parser.add_argument("--op-us", type=float, default=0.0,
                        help="fixed cost of one operation without a calibration (default 0)")
    parser.add_argument("--algorithm", choices=("ring", "tree"), default="ring")
    parser.add_argument("--servers", type=int, default=0,
                        help="parameter servers for the ps systems: 0 (default) one on each rank's machine, "
                             "N: that many on machines of their own")


def network_from(args: argparse.Namespace, rate: str) -> Network:
    """The network of :func:`add_network_arguments`' options with each rank's link at ``rate``
    (``25gbit``; ``none``: loopback, no link limit)."""
    return Network(parse_rate(rate), latency=args.latency_us * 1e-6, op_seconds=args.op_us * 1e-6,
                   algorithm=args.algorithm, servers=args.servers)
