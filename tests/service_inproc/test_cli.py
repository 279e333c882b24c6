"""The daemon's flags: policy choices are the core's own values, and --help states each
default exactly once."""

import dataclasses

import pytest

from radixkv_server.config import DaemonConfig, build_parser, load_config
from radixkv_server.core.cache_config import CacheConfig, StoragePolicy, WritePolicy


def choices(flag: str) -> list[str]:
    (action,) = [a for a in build_parser()._actions if flag in a.option_strings]
    return list(action.choices)


def test_policy_choices_are_the_cores():
    assert choices("--write-policy") == [p.value for p in WritePolicy]
    assert choices("--storage-policy") == [p.value for p in StoragePolicy if p is not StoragePolicy.OFF]
    for name in choices("--eviction-policy"):  # each one the core accepts
        assert CacheConfig(eviction_policy=name).eviction_policy == name
    with pytest.raises(ValueError):
        CacheConfig(eviction_policy="mru")
    with pytest.raises(SystemExit):
        load_config(["--eviction-policy", "mru"], environ={})


def test_help_states_each_default_once(capsys):
    with pytest.raises(SystemExit):
        load_config(["--help"], environ={})
    text = " ".join(capsys.readouterr().out.split())  # undo line wrapping
    assert "(default: None)" not in text
    assert text.count("(default:") == len(dataclasses.fields(DaemonConfig))
    assert "(default: 4GiB)" in text and "(default: write_through)" in text
    assert "{write_through,write_through_selective,write_back}" in text
