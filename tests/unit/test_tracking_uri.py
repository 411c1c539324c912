"""An MLflow trackingUri on a link-local address (a cloud's instance metadata service, which hands out the node's
credentials) is refused by the job's schema, however the address is written; other servers are taken."""

from __future__ import annotations

import pytest

from rlfleet.workers.spec import SpecError

from conftest import make_job


def _mlflow(uri: str):
    return make_job(tracking=[{"type": "mlflow", "trackingUri": uri}])


@pytest.mark.parametrize("uri", [
    "http://169.254.169.254/latest/meta-data/",
    "http://169.254.170.2:80",  # ECS task credentials
    "http://2852039166/",  # 169.254.169.254 as one number
    "http://0xa9fea9fe/",
    "http://169.254.43518/",
    "https://[fe80::a9fe:a9fe]:5000",
    "http://[::ffff:169.254.169.254]/",
    "http://metadata.google.internal/computeMetadata/v1/",
    "HTTP://METADATA.GOOGLE.INTERNAL./",
    "postgresql://user:secret@169.254.1.1/mlflow",
])
def test_a_link_local_tracking_uri_is_refused_naming_the_field(uri):
    with pytest.raises(SpecError, match="spec.tracking.0.trackingUri: .*link-local"):
        _mlflow(uri)


@pytest.mark.parametrize("uri", ["http://mlflow.tracking.svc:5000", "http://127.0.0.1:5000", "http://10.0.0.7",
                                 "https://[2001:db8::1]/", "sqlite:///runs/mlflow.db", "databricks"])
def test_other_tracking_uris_are_taken(uri):
    assert _mlflow(uri).spec.tracking[0].tracking_uri == uri
