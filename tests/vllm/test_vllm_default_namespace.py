"""The connector's default namespace: vLLM's model path, made a name the daemon takes."""

import pytest

from radixkv.vllm.config import ConnectorConfig, default_namespace
from radixkv_server.service.registration import check_namespace_name


SNAPSHOT = ("/root/.cache/huggingface/hub/models--meta-llama--Meta-Llama-3.1-405B-Instruct-FP8/snapshots/"
            "0123456789abcdef0123456789abcdef01234567")


@pytest.mark.parametrize("path, readable", [(SNAPSHOT, "FP8/snapshots/0123456789abcdef"),
                                            ("/models/My Model (v2)", "/models/My_Model__v2_-"),
                                            ("meta-llama/Llama-3.1-8B", "vllm/meta-llama/Llama-3.1-8B")])
def test_the_default_namespace_of_any_model_path_is_one_the_daemon_takes(path, readable):
    """A hub cache's snapshot path made "vllm/<path>" 137 characters and a space made it
    invalid: Register refused it (INVALID_ARGUMENT) and vLLM did not start. A name that
    was valid stays as it was."""
    name = ConnectorConfig.from_extra({}, path).namespace
    check_namespace_name(name)
    assert readable in name and name == default_namespace(path) != default_namespace(path + "x")
    assert (name == f"vllm/{path}") is (path == "meta-llama/Llama-3.1-8B")
