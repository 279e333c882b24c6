"""Server reflection (grpcio-reflection's servicer) that answers with the .proto's
comments, and resolves method names.

The contract lives in the comments of `proto/radixkv/v1/radixkv.proto`, but descriptors
built from the generated Python code carry none, so `grpcurl describe` showed bare
fields. `make proto` writes each file's descriptor with its source info
(`radixkv/v1/radixkv_source.binpb`); the answers here carry that one for radixkv's
files. grpcurl also describes a method by asking for the file of `pkg.Service.Method`,
which the descriptor pool does not resolve: such a name is answered with its service's
file. Everything else is grpcio-reflection's own.
"""

from importlib import resources

from google.protobuf import descriptor_pb2
from grpc_reflection.v1alpha import reflection

SOURCE = ("radixkv.v1", "radixkv_source.binpb")


def commented_files() -> dict[str, bytes]:
    """{file name: its serialized FileDescriptorProto, comments included}; empty when
    the package lacks the descriptor (an install from before it was generated). Fields
    carry no `json_name`, as in the descriptors of the generated code: grpcurl then
    writes and reads the proto's own field names (`page_size`), as it always did."""
    try:
        data = resources.files(SOURCE[0]).joinpath(SOURCE[1]).read_bytes()
    except (FileNotFoundError, ModuleNotFoundError):
        return {}
    files = descriptor_pb2.FileDescriptorSet.FromString(data).file
    for f in files:
        _drop_json_names(f.message_type)
    return {f.name: f.SerializeToString() for f in files}


def _drop_json_names(messages) -> None:
    for message in messages:
        for field in message.field:
            field.ClearField("json_name")
        _drop_json_names(message.nested_type)


class CommentedReflection(reflection.aio.ReflectionServicer):
    """`reflection.aio.ReflectionServicer` for `service_names`, answering radixkv's files
    with their comments and method names with their service's file."""

    def __init__(self, service_names):
        super().__init__(service_names)
        self._commented = commented_files()

    def _file_by_filename(self, request, filename):
        return self._with_comments(super()._file_by_filename(request, filename))

    def _file_containing_symbol(self, request, fully_qualified_name):
        response = super()._file_containing_symbol(request, fully_qualified_name)
        service = fully_qualified_name.rpartition(".")[0]
        if response.HasField("error_response") and service:
            try:
                self._pool.FindServiceByName(service)
            except KeyError:
                return response
            response = super()._file_containing_symbol(request, service)
        return self._with_comments(response)

    def _with_comments(self, response):
        if response.HasField("file_descriptor_response"):
            files = response.file_descriptor_response.file_descriptor_proto
            for i, serialized in enumerate(files):
                name = descriptor_pb2.FileDescriptorProto.FromString(serialized).name
                files[i] = self._commented.get(name, serialized)
        return response


__all__ = ["CommentedReflection", "commented_files"]
