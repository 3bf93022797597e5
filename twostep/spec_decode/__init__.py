"""Speculative decoding: guess k tokens cheaply, verify them in one target forward."""
