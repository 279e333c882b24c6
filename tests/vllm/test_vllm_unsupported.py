"""What the connector cannot serve is refused when vLLM starts, saying what, instead of
serving wrong KV (real vLLM where it runs here, vLLM's own config objects elsewhere).

Pipeline stages would each register as the same rank and load another stage's layers;
a sliding window's blocks are freed by vLLM while the request runs, so loads and saves
would name vLLM's null block; MLA's layout is not described yet.
"""

from types import SimpleNamespace

import pytest
import torch
from vllm.config import ParallelConfig
from vllm.v1.kv_cache_interface import (FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, MLAAttentionSpec,
                                        SlidingWindowSpec)

from radixkv.client import Client
from radixkv.vllm.supported import check_supported
from radixkv.vllm.testing import write_tiny_llama
from tests.vllm.engines import generate, prompt


def test_a_model_whose_every_layer_slides_fails_to_start_naming_why(engines, daemon, tmp_path):
    model = write_tiny_llama(str(tmp_path / "swa"), sliding_window=256)
    with pytest.raises(Exception, match="full-attention KV caches only") as refused:
        engines.start(daemon.target, model=model)
    assert "SlidingWindowSpec" in str(refused.value)
    with Client(daemon.target) as c:
        assert list(c.stats().namespaces) == []  # it never registered
    llm = engines.start(model=model)  # the same model without radixkv serves
    assert len(generate(llm, [prompt(300, seed=61)])[0].tokens) > 0


def _config(**parallel):
    return SimpleNamespace(parallel_config=ParallelConfig(**parallel))


@pytest.mark.parametrize("name, what", [("pipeline_parallel_size", "pipeline parallelism"),
                                        ("decode_context_parallel_size", "decode context parallelism")])
def test_parallelism_that_keys_other_kv_alike_is_refused(name, what):
    check_supported(_config(), None)  # one stage, tensor parallel only: served
    with pytest.raises(ValueError, match=f"{name} is 2; .* not {what}"):
        check_supported(SimpleNamespace(parallel_config=SimpleNamespace(**{name: 2})), None)


def _groups(spec) -> KVCacheConfig:
    return KVCacheConfig(num_blocks=8, kv_cache_tensors=[],
                         kv_cache_groups=[KVCacheGroupSpec(layer_names=["model.layers.0.self_attn.attn"],
                                                           kv_cache_spec=spec)])


def test_only_full_attention_kv_caches_are_served():
    common = dict(block_size=32, num_kv_heads=2, head_size=64, dtype=torch.float32)
    check_supported(_config(), _groups(FullAttentionSpec(**common)))
    check_supported(_config(), _groups(FullAttentionSpec(**common, sliding_window=64)))  # a hybrid's, promoted
    with pytest.raises(ValueError, match="model.layers.0.self_attn.attn is SlidingWindowSpec"):
        check_supported(_config(), _groups(SlidingWindowSpec(**common, sliding_window=64)))
    with pytest.raises(ValueError, match="MLA"):
        check_supported(_config(), _groups(MLAAttentionSpec(block_size=32, num_kv_heads=1, head_size=576,
                                                            dtype=torch.float32)))
    with pytest.raises(ValueError, match="non-causally"):
        check_supported(_config(), _groups(FullAttentionSpec(**common, non_causal=True)))


def test_a_vllm_release_other_than_the_tested_one_is_warned_about(caplog):
    """The connector builds on vLLM's internals; the packaging review found nothing that
    said which release it was tested with, and other releases failed without a word why."""
    from radixkv.vllm.supported import TESTED_VLLM, check_version
    import vllm

    with caplog.at_level("WARNING", logger="vllm.radixkv"):
        assert check_version() is True  # the one installed for these tests
        assert caplog.records == []
        assert check_version("0.40.1") is False
    assert "tested with vLLM %d.%d, this is vLLM 0.40.1" % TESTED_VLLM in caplog.text
    assert vllm.__version__.startswith("%d.%d." % TESTED_VLLM)


def test_vllm_finds_the_connector_by_its_name_alone():
    """With radixkv installed, vLLM's plugin of it names the connector: kv_connector
    "RadixKVConnector" without kv_connector_module_path was "Unsupported connector type"
    (the packaging review). A fresh interpreter, as each vLLM process loads its plugins."""
    import subprocess
    import sys

    script = """
from vllm.plugins import load_general_plugins
load_general_plugins()
from vllm.config import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
cls = KVConnectorFactory.get_connector_class(KVTransferConfig(kv_connector="RadixKVConnector", kv_role="kv_both"))
print(cls.__module__, cls.__name__)
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split()[-2:] == ["radixkv.vllm.connector", "RadixKVConnector"]
