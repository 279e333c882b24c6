"""radixkv for vLLM: `RadixKVConnector`, a KV connector vLLM loads with

    kv_transfer_config={"kv_connector": "RadixKVConnector",
                        "kv_connector_module_path": "radixkv.vllm", "kv_role": "kv_both",
                        "kv_connector_extra_config": {"target": "unix:///run/radixkv/radixkv.sock"}}

or with "kv_connector": "RadixKVConnector" alone where radixkv is installed: `register`,
vLLM's plugin of this distribution, names it in vLLM's connector factory.

Importing this package does not import vLLM; `RadixKVConnector` does (on first use), so
`radixkv.vllm.testing` and `radixkv.vllm.kvmemory` work without it. Supported: vLLM 0.32
(the CPU build is tested; the CUDA path is written, proven only on a GPU: docs/vllm.md).
"""

__all__ = ["RadixKVConnector", "register"]

CONNECTOR = ("RadixKVConnector", "radixkv.vllm.connector", "RadixKVConnector")


def register() -> None:
    """vLLM's general plugin (entry point `vllm.general_plugins`, run in every vLLM
    process): names RadixKVConnector in vLLM's connector factory, lazily (nothing is
    imported until vLLM builds the connector). Never raises: vLLM does not catch a
    plugin's error, and a failure here must not stop an engine that does not use it."""
    try:
        from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
        KVConnectorFactory.register_connector(*CONNECTOR)
    except Exception:  # already named (a second call), or a vLLM without this factory
        pass


def __getattr__(name: str):
    if name == "RadixKVConnector":
        from .connector import RadixKVConnector
        return RadixKVConnector
    raise AttributeError(f"module 'radixkv.vllm' has no attribute {name!r}")
