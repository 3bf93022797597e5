"""The engine core: request state, the scheduler (the one owner of request and KV state after a
step), the stop rules, the model runner, the builder of a model and its cache, and the Proposer
protocol speculative decoding plugs into."""
