"""/metrics of the one endpoint: every replica's own metrics (the single server's names) with a
`replica` label, and the router's: where requests went, why, and how much of their prompt the chosen
replica had seen (the expected prefix-cache hit; the replicas' prefix_cache_hits say what it was).
"""
from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families

from twostep.entrypoints.openai.metrics import PREFIX

MATCH_BUCKETS = [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0]


class FrontMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.routed = Counter(PREFIX + "router_requests", "Requests routed, by replica and decision "
                              "(prefix, least_loaded, balance, round_robin, pinned, overflow).", ["replica", "decision"],
                              registry=self.registry)
        self.match = Histogram(PREFIX + "router_prefix_match_ratio", "Share of a routed prompt's leading "
                               "blocks the chosen replica was sent before.", buckets=MATCH_BUCKETS,
                               registry=self.registry)
        self.failures = Counter(PREFIX + "router_replica_failures", "Requests ended because their replica "
                                "failed (died, or could not be reached).", registry=self.registry)
        self.replicas = Gauge(PREFIX + "router_replicas", "Live replicas.", registry=self.registry)

    def render(self, replica_texts: dict[str, str]) -> bytes:
        merged = CollectorRegistry()
        merged.register(_Families(with_replica_label(replica_texts)))
        return generate_latest(self.registry) + generate_latest(merged)


def with_replica_label(replica_texts: dict[str, str]) -> list[Metric]:
    """The replicas' metric families merged, each sample labelled with its replica."""
    families: dict[str, Metric] = {}
    for replica, text in sorted(replica_texts.items()):
        for family in text_string_to_metric_families(text):
            merged = families.setdefault(family.name, Metric(family.name, family.documentation, family.type))
            for s in family.samples:
                merged.add_sample(s.name, {**s.labels, "replica": replica}, s.value, s.timestamp, s.exemplar)
    return list(families.values())


class _Families:
    def __init__(self, families: list[Metric]) -> None:
        self.families = families

    def collect(self):
        return self.families
