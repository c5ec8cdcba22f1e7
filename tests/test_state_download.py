"""A state download arrives whole or is asked again: trahiv's server ends a state with an empty message and says in the
metadata how many tensors it sends (trahiv.engine.averagers.VersionedSchema.rpc_download_state), and its downloader
(CheckedStateDownload._download_state_from) takes a stream that ended before that for a failed download. A stream cut
between two tensors looked whole before: a late peer of a clean-clone run of tests/test_optim8bit.py got 84 of its
swarm's 116 tensors, rejected them for their number, and trained from its own weights. Each averager runs in its own
process (hivemind's), the server cutting its first answer after two of its five tensors."""

from __future__ import annotations

import logging
import sys
from contextlib import ExitStack
from typing import Any, AsyncIterator  # noqa: UP035  (hivemind finds streaming RPCs by typing.AsyncIterator)

import torch
from hivemind.p2p import P2PContext
from hivemind.proto import averaging_pb2
from swarm_helpers import local_dht

from trahiv import engine
from trahiv.engine.averagers import CheckedStateDownload

engine.apply()

SERVED = [torch.full((1000,), float(index)) for index in range(5)]


class CuttingServer(CheckedStateDownload):
    """Serves SERVED at step 1; its first answer ends after the parts of two tensors, as a stream that p2pd cut."""

    with_count = True  # the server announces how many tensors it sends (False: as a server that does not)

    def get_current_state(self) -> Any:
        return {"epoch": 1}, SERVED, None

    async def _get_current_state_from_host_process(self) -> Any:
        metadata, tensors, infos = await super()._get_current_state_from_host_process()
        if not self.with_count:
            loaded = self.serializer.loads(metadata)
            metadata = self.serializer.dumps({key: value for key, value in loaded.items() if key != "tensors"})
        return metadata, tensors, infos

    async def rpc_download_state(
        self, request: averaging_pb2.DownloadRequest, context: P2PContext
    ) -> AsyncIterator[averaging_pb2.DownloadData]:
        first = not getattr(self, "_answered", False)
        self._answered, begun = True, 0
        async for message in super().rpc_download_state(request, context):
            begun += bool(message.tensor_part.dtype)  # (a dtype marks a tensor's first part)
            if first and begun > 2:
                return  # the stream ends here
            yield message


def download(stack: ExitStack) -> tuple[Any, list[torch.Tensor]] | None:
    server_dht = stack.enter_context(local_dht())
    client_dht = stack.enter_context(local_dht(server_dht.get_visible_maddrs()))
    server = CuttingServer([torch.zeros(1)], dht=server_dht, prefix="cut", start=True, allow_state_sharing=True)
    stack.callback(server.shutdown)
    server.state_sharing_priority = 1
    client = CuttingServer([torch.zeros(1)], dht=client_dht, prefix="cut", start=True, client_mode=True)
    stack.callback(client.shutdown)
    return client.load_state_from_peers(timeout=30)


def test_a_state_cut_short_is_asked_for_again(capfd):
    with ExitStack() as stack:
        handler = logging.StreamHandler(sys.stderr)  # (the averagers' processes fork with it: capfd reads them)
        logging.getLogger("trahiv.averaging").addHandler(handler)
        stack.callback(logging.getLogger("trahiv.averaging").removeHandler, handler)
        loaded = download(stack)
    assert loaded is not None
    metadata, tensors = loaded
    assert metadata["epoch"] == 1 and metadata["tensors"] == len(SERVED), metadata
    assert len(tensors) == len(SERVED) and all(torch.equal(a, b) for a, b in zip(tensors, SERVED, strict=True))
    assert "StateCutShort('the stream ended after 2 of 5 tensors') (asking it again" in capfd.readouterr().err


def test_without_the_count_a_cut_state_looks_whole(monkeypatch):
    """The control: a server that does not announce its tensors (hivemind's way) and the same cut: the downloader
    takes the first two tensors for the whole state."""
    monkeypatch.setattr(CuttingServer, "with_count", False)  # (the averagers' processes fork with it)
    with ExitStack() as stack:
        loaded = download(stack)
    assert loaded is not None and len(loaded[1]) == 2, loaded
