"""The worker's bearer token is not in the text of the objects that hold it.

``ChannelConfig`` (``HiCacheClient(...).config``) and the SGLang adapter's ``AdapterConfig``
were plain dataclasses: their ``repr`` -- what a log line, a traceback's locals or SGLang's own
config dump writes -- held ``token='...'`` in clear.
"""

from __future__ import annotations

from hicached_client import HiCacheClient
from hicached_client.sglang.config import AdapterConfig

SECRET = "s3cret-bearer-token"


def test_the_token_is_not_in_a_configs_repr() -> None:
    with HiCacheClient("unix:///run/hicached/hicached.sock", token=SECRET) as client:
        assert client.config.token == SECRET
        assert SECRET not in repr(client.config) and SECRET not in str(client.config)
    adapter = AdapterConfig(target="unix:///run/hicached/hicached.sock", token=SECRET)
    assert adapter.token == SECRET
    assert SECRET not in repr(adapter) and SECRET not in str(adapter)
