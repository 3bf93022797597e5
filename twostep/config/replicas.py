"""`twostep serve`'s data-parallel options: engine replicas on Ray Serve behind one OpenAI endpoint
(twostep/entrypoints/replicas). With none of them set the server runs one engine in its own process."""
from __future__ import annotations

from dataclasses import dataclass

from twostep.config.options import option

ROUTING_POLICIES = ("prefix_aware", "round_robin")
GROUP = "replicas (Ray Serve; pip install 'twostep[ray]')"


@dataclass(slots=True)
class ReplicaConfig:
    """Engine replicas on Ray Serve behind the one endpoint (`twostep serve`)."""

    data_parallel_size: int = option(1, "engine replicas, each a Ray Serve replica with its own model copy and "
                                     "KV cache, behind this server's one endpoint (> 1, or --ray-address, "
                                     "or --min/--max-replicas: on Ray)", short="-dp", group=GROUP)
    ray_address: str | None = option(None, "a running Ray cluster to place the replicas on (`ray start --head` "
                                     "on one machine, `ray start --address HEAD:6379` on the others; "
                                     "auto: $RAY_ADDRESS); unset: a local cluster on this machine",
                                     group=GROUP)
    min_replicas: int | None = option(None, "autoscale: replicas kept at the least (with --max-replicas; "
                                      "Ray Serve adds and removes replicas by requests in flight)",
                                      group=GROUP)
    max_replicas: int | None = option(None, "autoscale: replicas at the most", group=GROUP)
    target_ongoing_requests: float | None = option(None, "autoscale: requests in flight per replica Ray "
                                                   "Serve aims at (default: --max-num-seqs)", group=GROUP)
    routing_policy: str = option("prefix_aware", "prefix_aware: a request goes to the replica that served "
                                 "its prompt's longest prefix (its KV blocks are likely cached there), the "
                                 "least loaded when none did or when load is imbalanced; round_robin: "
                                 "in turn", choices=ROUTING_POLICIES, group=GROUP)
    routing_imbalance: int = option(4, "requests in flight by which a replica may lead the idlest and still "
                                    "get the requests whose prefix it holds; a busier one is passed over "
                                    "for the best match among the others", group=GROUP)
    replica_cpus: float = option(1.0, "CPUs Ray reserves for each replica (times --tensor-parallel-size); "
                                 "a replica's engine uses as many threads", group=GROUP)
    prefill_replicas: int = option(0, "prefill/decode disaggregation on Ray: this many prefill replicas "
                                   "(kv_producer) and --decode-replicas decode replicas (kv_consumer); each "
                                   "request is prefilled on one, its KV blocks move to the other, which "
                                   "decodes", group=GROUP)
    decode_replicas: int = option(0, "decode replicas, with --prefill-replicas", group=GROUP)

    def __post_init__(self) -> None:
        if self.data_parallel_size < 1:
            raise ValueError(f"--data-parallel-size must be at least 1; got {self.data_parallel_size}")
        if (self.min_replicas is None) != (self.max_replicas is None):
            raise ValueError("autoscaling needs both --min-replicas and --max-replicas")
        if self.min_replicas is not None and not 0 <= self.min_replicas <= self.max_replicas or \
                self.max_replicas is not None and self.max_replicas < 1:
            raise ValueError(f"need 0 <= --min-replicas <= --max-replicas and --max-replicas >= 1; got "
                             f"{self.min_replicas} and {self.max_replicas}")
        if self.routing_imbalance < 0:
            raise ValueError(f"--routing-imbalance must be >= 0; got {self.routing_imbalance}")
        if self.replica_cpus <= 0:
            raise ValueError(f"--replica-cpus must be > 0; got {self.replica_cpus}")
        if (self.prefill_replicas > 0) != (self.decode_replicas > 0):
            raise ValueError("disaggregation on Ray needs both --prefill-replicas and --decode-replicas")
        if self.disaggregated and (self.autoscaling or self.data_parallel_size > 1):
            raise ValueError("--prefill-replicas/--decode-replicas size both pools: leave out "
                             "--data-parallel-size and --min/--max-replicas")

    @property
    def autoscaling(self) -> bool:
        return self.max_replicas is not None

    @property
    def disaggregated(self) -> bool:
        return self.prefill_replicas > 0

    @property
    def on_ray(self) -> bool:
        """Any of the options asks for replicas: the server runs them on Ray."""
        return (self.data_parallel_size > 1 or self.ray_address is not None or self.autoscaling
                or self.disaggregated)
