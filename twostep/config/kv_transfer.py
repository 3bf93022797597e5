"""`--kv-transfer-config`: prefill/decode disaggregation, vLLM's JSON keys.

    {"kv_connector": "ZmqConnector", "kv_role": "kv_producer", "kv_port": 14579}
    {"kv_connector": "ZmqConnector", "kv_role": "kv_consumer", "kv_load_failure_policy": "recompute"}

A producer (the prefill instance) keeps a finished prefill's KV blocks under a lease and serves
them on kv_ip:kv_port; a consumer (the decode instance) pulls them into its own blocks.
kv_both does either, per request. kv_connector_extra_config: lease_s (how long a producer keeps
unclaimed blocks, 30 s by default; a consumer whose request waits to be admitted extends it
every third of it) and timeout_s
(how long a consumer waits for a producer's answer before the load counts as failed).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field, fields

logger = logging.getLogger(__name__)

CONNECTORS = ("ZmqConnector",)
ROLES = ("kv_producer", "kv_consumer", "kv_both")
FAILURE_POLICIES = ("fail", "recompute")
EXTRA_KEYS = {"lease_s": 30.0, "timeout_s": 10.0}
# vLLM's keys that mean nothing for this connector (ranks of its older P2P connectors, buffer
# placement): accepted, so vLLM command lines run, and logged
IGNORED_KEYS = ("kv_rank", "kv_parallel_size", "kv_buffer_device", "kv_buffer_size", "kv_connector_module_path")


@dataclass(slots=True)
class KVTransferConfig:
    kv_connector: str = "ZmqConnector"
    kv_role: str = "kv_both"
    kv_ip: str = "127.0.0.1"          # where a producer listens and what it tells consumers: across
                                      # machines, this machine's address that the decode instances reach
    kv_port: int = 14579              # 0: any free port
    engine_id: str | None = None      # named in transfer parameters and logs; default host:port
    kv_load_failure_policy: str = "fail"   # fail: the request ends with an error; recompute: prefill here
    kv_connector_extra_config: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"kv_connector must be one of {', '.join(CONNECTORS)}; got {self.kv_connector!r}")
        if self.kv_role not in ROLES:
            raise ValueError(f"kv_role must be one of {', '.join(ROLES)}; got {self.kv_role!r}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"kv_load_failure_policy must be one of {', '.join(FAILURE_POLICIES)}; "
                             f"got {self.kv_load_failure_policy!r}")
        if not isinstance(self.kv_port, int) or not 0 <= self.kv_port < 65536:
            raise ValueError(f"kv_port must be a port number, got {self.kv_port!r}")
        unknown = sorted(set(self.kv_connector_extra_config) - set(EXTRA_KEYS))
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys {unknown}; known: {sorted(EXTRA_KEYS)}")
        for key in EXTRA_KEYS:
            value = self.extra(key)
            if not isinstance(value, (int, float)) or value <= 0:
                raise ValueError(f"kv_connector_extra_config {key} must be a positive number, got {value!r}")

    def extra(self, key: str) -> float:
        return self.kv_connector_extra_config.get(key, EXTRA_KEYS[key])

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("kv_producer", "kv_both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("kv_consumer", "kv_both")

    @classmethod
    def parse(cls, value: "KVTransferConfig | dict | str | None") -> "KVTransferConfig | None":
        """From a KVTransferConfig, a dict, or its JSON text (as --kv-transfer-config takes it)."""
        if value is None or isinstance(value, KVTransferConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as e:
                raise ValueError(f"kv transfer config is not valid JSON: {e}") from None
        if not isinstance(value, dict):
            raise ValueError("kv transfer config must be a JSON object")
        known = {f.name for f in fields(cls)}
        ignored = sorted(set(value) & set(IGNORED_KEYS))
        if ignored:
            logger.info("kv transfer config: %s not used by twostep's connectors (ignored)", ", ".join(ignored))
        unknown = sorted(set(value) - known - set(IGNORED_KEYS))
        if unknown:
            raise ValueError(f"unknown kv transfer config keys {unknown}; known: {sorted(known)}")
        return cls(**{k: v for k, v in value.items() if k in known})
