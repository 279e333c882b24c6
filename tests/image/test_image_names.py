"""The image names agree (no Docker needed, so this runs in `make test` too): the
Kubernetes example names an image `make image-push` produces, the Makefile's default is
radixkv:<version in pyproject.toml>, and docs/image.md gives the command for the tag the
manifest uses."""

import os
import re
import subprocess
import tomllib

import yaml

from dockertools import REPO

VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]
MANIFEST = REPO / "deploy" / "kubernetes" / "engine-with-radixkv.yaml"


def pushed_by_make(*variables: str) -> str:
    """The reference `make image-push` would push, read from its dry run."""
    # Not the settings of a `make test` this runs under (jobserver, -n, variables).
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MFLAGS", "MAKELEVEL")}
    done = subprocess.run(["make", "-n", "--no-print-directory", "image-push", *variables],
                          cwd=REPO, env=env, capture_output=True, text=True, timeout=60, check=True)
    (push,) = [line.split()[-1] for line in done.stdout.splitlines() if line.startswith("docker push ")]
    return push


def sidecar_image() -> str:
    for doc in yaml.safe_load_all(MANIFEST.read_text()):
        if doc and doc["kind"] == "Deployment":
            (side,) = [c for c in doc["spec"]["template"]["spec"]["initContainers"] if c["name"] == "radixkv"]
            return side["image"]
    raise AssertionError(f"no Deployment in {MANIFEST}")


def test_make_image_default_is_the_package_version():
    assert pushed_by_make("REGISTRY=registry.example.com") == f"registry.example.com/radixkv:{VERSION}"


def test_manifest_names_an_image_make_image_push_produces():
    image = sidecar_image()
    m = re.fullmatch(r"(?P<registry>[^/]+(?:/[^/]+)*)/radixkv:(?P<tag>[\w.-]+)", image)
    assert m, f"{image}: not <registry>/radixkv:<tag>"
    tag = m["tag"]
    assert re.fullmatch(re.escape(VERSION) + r"(-cu\d+)?", tag), f"tag {tag} is not {VERSION}[-cuNNN]"
    assert pushed_by_make(f"REGISTRY={m['registry']}", f"IMAGE_TAG={tag}") == image
    docs = (REPO / "docs" / "image.md").read_text()
    assert f"IMAGE_TAG={tag}" in docs and image in docs, "docs/image.md does not say how to build it"
