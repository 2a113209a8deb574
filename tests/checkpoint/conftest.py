from __future__ import annotations

import pytest

from tests.checkpoint.builders import StoreTarget
from tests.s3_server import s3_endpoint, s3_server  # noqa: F401  (fixtures)


@pytest.fixture(params=["file", "s3"])
def target(request: pytest.FixtureRequest, tmp_path) -> StoreTarget:
    """The same test against a local directory and against a real S3 endpoint (moto server)."""
    if request.param == "file":
        root = tmp_path / "ckpt"
        return StoreTarget("file", f"file://{root}", root=root)
    ep = request.getfixturevalue("s3_endpoint")
    return StoreTarget("s3", ep.uri("jobs/job-1"), endpoint=ep, prefix="jobs/job-1")
