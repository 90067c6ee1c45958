"""Answering one scrape of the supervisor's pod endpoint as its loop does."""

from __future__ import annotations

import selectors

from kvguard.ops.pod_endpoint import PodEndpoint


def serve_the_scrape(endpoint: PodEndpoint) -> None:
    """Wait (up to 5 s) for a scrape to arrive on `endpoint`, then answer it as the
    supervisor's loop does."""
    with selectors.DefaultSelector() as selector:
        selector.register(endpoint, selectors.EVENT_READ)
        assert selector.select(5), "the scrape to arrive"
    endpoint.serve_one()
