"""bytescheduler: a communication scheduler for data-parallel training (ByteScheduler, SOSP'19)."""

import os
import re

from setuptools import setup

HERE = os.path.dirname(os.path.abspath(__file__))


def read(*parts):
    with open(os.path.join(HERE, *parts), encoding="utf-8") as handle:
        return handle.read()


VERSION = re.search(r'^__version__ = "([^"]+)"', read("bytescheduler_py", "__init__.py"), re.M).group(1)

setup(
    name="bytescheduler",
    version=VERSION,
    description="Priority, partition, merge and credit scheduling of gradient communication "
    "for PyTorch DDP, Horovod and MXNet",
    long_description=read("README.md"),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.9",
    package_dir={"bytescheduler": "bytescheduler_py"},
    # The library alone: the benchmark, the demo and the simulator are bytescheduler-tools (tools/).
    packages=["bytescheduler", "bytescheduler.core", "bytescheduler.pytorch", "bytescheduler.mxnet"],
    package_data={"bytescheduler": ["py.typed"]},
    # torch.distributed's and Horovod's object collectives, which set the schedulers up, read
    # through numpy, and the MXNet adapter imports it; MXNet's own numpy pin satisfies this.
    install_requires=["numpy"],
    extras_require={
        "torch": ["torch>=2.1"],
        # Horovod 0.28.1 ships only as an sdist that needs build settings an extra cannot carry:
        # `make horovod` (scripts/install_horovod.sh) builds and installs it, then this is met.
        "horovod": ["torch>=2.1", "horovod>=0.28.1"],
        "lightning": ["torch>=2.1", "lightning>=2.6"],
        "huggingface": ["torch>=2.1", "accelerate>=1.15", "transformers>=5"],
        "test": ["torch>=2.1", "pytest>=7", "pytest-timeout>=2", "matplotlib"],
    },
    entry_points={"console_scripts": ["bytescheduler=bytescheduler.cli:main"]},
    classifiers=[
        "Programming Language :: Python :: 3",
        "Topic :: Scientific/Engineering :: Artificial Intelligence",
        "Topic :: System :: Distributed Computing",
    ],
)
