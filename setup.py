"""The one build step pyproject.toml cannot declare: kvguard/v1's gRPC stubs, generated from
proto/ by grpcio-tools as the wheel is built (they are not committed)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py

PROTO_ROOT = "proto"
PROTOS = ("kvguard/v1/admin.proto",)
# What grpc_tools.protoc writes for each .proto: messages, their type stubs, the service.
SUFFIXES = ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")


class BuildPyWithStubs(build_py):
    """build_py, then the stubs written into the build directory over any copy in the tree, so
    that a stale local copy never ships.

    An editable install reads kvguard/ in place: there the Makefile generates the stubs.
    """

    def run(self) -> None:
        if not self.editable_mode:
            # bdist_wheel packs all of build/lib: what an earlier build left there (a module
            # since removed or excluded) would ship too.
            shutil.rmtree(self.build_lib, ignore_errors=True)
        super().run()
        if not self.editable_mode:
            self._generate(Path(self.build_lib))

    def get_outputs(self, include_bytecode: bool = True) -> list[str]:
        outputs = list(super().get_outputs(include_bytecode))
        if not self.editable_mode:
            outputs += [str(Path(self.build_lib) / path) for path in _stubs()]
        return sorted(set(outputs))

    def _generate(self, out: Path) -> None:
        command = [
            sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO_ROOT}",
            f"--python_out={out}", f"--pyi_out={out}", f"--grpc_python_out={out}", *PROTOS,
        ]  # fmt: skip
        self.announce("generating the gRPC stubs: " + " ".join(command), level=2)
        result = subprocess.run(command, capture_output=True, text=True, check=False)
        if result.returncode != 0:
            raise SystemExit(
                f"grpc_tools.protoc failed (exit {result.returncode}); grpcio-tools is a build "
                f"requirement:\n{result.stdout}{result.stderr}"
            )
        missing = [path for path in _stubs() if not (out / path).is_file()]
        if missing:
            raise SystemExit(f"grpc_tools.protoc did not write {missing}")


def _stubs() -> list[str]:
    return [proto.removesuffix(".proto") + suffix for proto in PROTOS for suffix in SUFFIXES]


setup(cmdclass={"build_py": BuildPyWithStubs})
