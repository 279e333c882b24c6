"""vLLM's asynchronous scheduling, which the CPU build turns off, turned on for a test.

On GPUs vLLM schedules step N+1 while step N's forward runs (on by default): the
connector's scheduler side then plans a step before the workers' reports of the one
before it arrive. vLLM's CPU platform sets `async_scheduling = False`; the model runner
it shares with the GPU build would run it, but for the CUDA stream and events it uses to
copy sampled tokens to the host without waiting. On CPU those copies are synchronous, so
stand-ins that do nothing are exact: the scheduler, the engine core's batch queue and the
connector run as on a GPU.

`asynchronous_scheduling(monkeypatch)` installs both for the test (undone after it);
engines started meanwhile schedule asynchronously (`scheduler_config.async_scheduling`).
"""

import contextlib

import torch


class _Event:
    """torch.cuda.Event on CPU: the work it would mark is already done."""

    def __init__(self, *args, **kwargs):
        pass

    def record(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def wait(self, *args, **kwargs) -> None:
        pass

    def query(self) -> bool:
        return True


class _Stream:
    """torch.cuda.Stream on CPU: every operation runs in order on the caller's thread."""

    device = torch.device("cpu")

    def __init__(self, *args, **kwargs):
        pass

    def wait_stream(self, *args, **kwargs) -> None:
        pass

    def wait_event(self, *args, **kwargs) -> None:
        pass

    def synchronize(self) -> None:
        pass


def asynchronous_scheduling(monkeypatch) -> None:
    from vllm.platforms.cpu import CpuPlatform

    check = CpuPlatform.check_and_update_config.__func__

    def check_and_update_config(cls, vllm_config) -> None:
        check(cls, vllm_config)
        vllm_config.scheduler_config.async_scheduling = True

    monkeypatch.setattr(CpuPlatform, "check_and_update_config", classmethod(check_and_update_config))
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "Stream", _Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args, **kwargs: _Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
