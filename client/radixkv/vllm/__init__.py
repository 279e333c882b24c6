"""radixkv for vLLM: `RadixKVConnector`, a KV connector vLLM loads with

    kv_transfer_config={"kv_connector": "RadixKVConnector",
                        "kv_connector_module_path": "radixkv.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"target": "unix:///run/radixkv/radixkv.sock"}}

Importing this package does not import vLLM; `RadixKVConnector` does (on first use), so
`radixkv.vllm.testing` and `radixkv.vllm.kvmemory` work without it. Supported: vLLM 0.32
(the CPU build is tested; the CUDA path is written, proven only on a GPU: docs/vllm.md).
"""

__all__ = ["RadixKVConnector"]


def __getattr__(name: str):
    if name == "RadixKVConnector":
        from .connector import RadixKVConnector
        return RadixKVConnector
    raise AttributeError(f"module 'radixkv.vllm' has no attribute {name!r}")
