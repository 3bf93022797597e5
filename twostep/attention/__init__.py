"""Attention over the paged KV cache for one flat, mixed batch, behind a small backend interface.

The model runner builds only the common metadata (metadata.py); each backend turns it into what it
needs once per step (build_metadata) and runs every layer from that (forward). The backend the
engine uses composes a prefill path and a decode path (backend.py: HybridBackend), chosen by name
and platform in selector.py.
"""
