"""The connector a KVTransferConfig names."""
from __future__ import annotations

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.config.kv_transfer import KVTransferConfig
from twostep.kv_transfer.connector import KVConnector


def make_connector(config: KVTransferConfig, caches: list[KVLayerCache]) -> KVConnector:
    # imported here: zmq costs ~20 ms of every start-up, and only disaggregated instances use it
    from twostep.kv_transfer.zmq_connector import ZmqConnector

    connectors = {"ZmqConnector": ZmqConnector}
    return connectors[config.kv_connector](config, caches)
