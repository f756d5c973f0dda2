"""Installs the kvagent Python client from this checkout, offline, on Debian's Python:

    /usr/bin/python3 -m pip install --no-build-isolation --no-deps --target DIR ./python

(then PYTHONPATH=DIR), or in a venv made with --system-site-packages (so it sees
python3-grpcio, -protobuf, -numpy, -torch) without --target. The stubs are generated
at build time by gen_stubs.py with Debian's protoc and grpc_python_plugin.
"""
import os

from setuptools import setup
from setuptools.command.build_py import build_py

HERE = os.path.dirname(os.path.abspath(__file__))


class BuildWithStubs(build_py):
    def run(self):
        super().run()
        import importlib.util
        spec = importlib.util.spec_from_file_location("gen_stubs", os.path.join(HERE, "gen_stubs.py"))
        gen = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(gen)
        proto = os.path.join(HERE, "..", "proto", "kvagent.proto")
        if not os.path.exists(proto):
            proto = os.path.join(HERE, "kvagent.proto")  # a copy beside setup.py
        gen.generate(proto, os.path.join(self.build_lib, "kvagent", "_proto"))


setup(
    name="kvagent",
    version="0.1.0",
    description="Python client of the kvagent KV-cache transfer agent",
    packages=["kvagent", "kvagent._proto"],
    python_requires=">=3.9",
    cmdclass={"build_py": BuildWithStubs},
)
