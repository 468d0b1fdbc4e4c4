"""bytescheduler-tools: the benchmark, the demo, soak and chaos, the simulator (beside the library)."""

import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))
with open(os.path.join(HERE, "..", "bytescheduler_py", "__init__.py"), encoding="utf-8") as handle:
    VERSION = re.search(r'^__version__ = "([^"]+)"', handle.read(), re.M).group(1)

setup(
    name="bytescheduler-tools",
    version=VERSION,
    description="bytescheduler's benchmark, demo, soak and chaos campaigns and simulator",
    license="Apache-2.0",
    python_requires=">=3.9",
    packages=["bytescheduler_tools", "bytescheduler_tools.bench", "bytescheduler_tools.sim"],
    # torch for the torch systems and the measured profiles (MXNet's environment has none: it
    # installs this with --no-deps and runs only the MXNet workers), matplotlib for the charts.
    install_requires=[f"bytescheduler=={VERSION}", "torch>=2.1", "matplotlib"],
    entry_points={"bytescheduler.commands": ["tools = bytescheduler_tools.cli:COMMANDS"]},
)
