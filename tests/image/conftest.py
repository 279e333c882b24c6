"""Fixtures of the image tests (tests/image): the image `make image` built, named by
RADIXKV_TEST_IMAGE, which `make test-image` sets after building it. Without it (a plain
`make test`) the tests that need the image are not collected (not a suite skipped on
every run); .ci/run runs `make test-image`. The size of the image is reported in
pytest's summary."""

import os

import pytest

from dockertools import DaemonContainer, docker, inspect

IMAGE_ENV = "RADIXKV_TEST_IMAGE"
collect_ignore = [] if os.environ.get(IMAGE_ENV) else ["test_image_container.py"]


@pytest.fixture(scope="session")
def image() -> str:
    name = os.environ.get(IMAGE_ENV)
    if not name:
        pytest.skip(f"needs the built image: `make test-image` builds it and sets {IMAGE_ENV}")
    if docker("image", "inspect", name, check=False).returncode != 0:
        pytest.fail(f"{IMAGE_ENV}={name}: no such image; `make image` builds it", pytrace=False)
    return name


@pytest.fixture(scope="session")
def image_config(image) -> dict:
    """`docker image inspect` of the image."""
    return inspect(image)


@pytest.fixture(scope="module")
def daemon(image):
    """One container of the image, shared by a module's tests; removed with its volume."""
    container = DaemonContainer(image).start()
    yield container
    container.remove()


def pytest_terminal_summary(terminalreporter):
    name = os.environ.get(IMAGE_ENV)
    if not name:
        return
    try:
        done = docker("image", "inspect", "-f", "{{.Size}}", name, check=False)
    except OSError:  # no docker CLI: the tests said so already
        return
    if done.returncode == 0:
        size = int(done.stdout)
        terminalreporter.write_line(f"image {name}: {size / 1e6:.0f} MB ({size / 2**30:.2f} GiB)")
