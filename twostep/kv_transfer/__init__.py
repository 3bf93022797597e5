"""Prefill/decode disaggregation: KV blocks of a finished prefill moved from one engine instance
(the producer) to another (the consumer). connector.py is the interface (vLLM's KVConnector shape),
zmq_connector.py the implementation on pyzmq, blocks.py what is moved, params.py what a request
carries."""
