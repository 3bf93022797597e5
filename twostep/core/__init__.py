"""The engine core, in two halves that share only the step's messages (step_outputs.py):
scheduling/ (request state, the scheduler, the one owner of request and KV state after a step, the
stop rules, the record of what the runner holds, the Proposer protocol speculative decoding plugs
into) and execution/ (the model runner with its own state of the requests, the builder of a model
and its cache, tensor parallelism's processes)."""
