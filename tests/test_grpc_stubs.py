"""The checked-in gRPC stubs are treadle.proto's: protoc's descriptor of the proto equals the one
treadle_pb2 carries (importing it has run protobuf's gencode/runtime version check), so an edit
to the proto without regenerating (the command in its header) fails here."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from google.protobuf import descriptor_pb2

from treadle.server.grpc import treadle_pb2 as pb

ROOT = Path(__file__).resolve().parents[1]
PROTO = "treadle/server/grpc/treadle.proto"


def test_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools")
    out = tmp_path / "treadle.desc"
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.",
                    f"--descriptor_set_out={out}", PROTO], cwd=ROOT, check=True)
    compiled = descriptor_pb2.FileDescriptorSet.FromString(out.read_bytes()).file[0]
    for message in compiled.message_type:
        drop_json_names(message)
    assert compiled == descriptor_pb2.FileDescriptorProto.FromString(pb.DESCRIPTOR.serialized_pb)
    # The field gRPC clients pick an adapter by.
    assert pb.GenerateRequest.DESCRIPTOR.fields_by_name["model"].number == 2


def drop_json_names(message: descriptor_pb2.DescriptorProto) -> None:
    """protoc's descriptor sets name each field's JSON name; the Python stubs leave it out."""
    for field in message.field:
        field.ClearField("json_name")
    for nested in message.nested_type:
        drop_json_names(nested)
