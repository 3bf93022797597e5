"""The connector a KVTransferConfig names."""
from __future__ import annotations

from twostep.attention.kv_layer_cache import KVLayerCache
from twostep.config.kv_transfer import KVTransferConfig
from twostep.kv_transfer.connector import KVConnector
from twostep.kv_transfer.zmq_connector import ZmqConnector

CONNECTORS = {"ZmqConnector": ZmqConnector}


def make_connector(config: KVTransferConfig, caches: list[KVLayerCache]) -> KVConnector:
    return CONNECTORS[config.kv_connector](config, caches)
