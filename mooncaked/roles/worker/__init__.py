"""The workers: the model-holding runtime shared by the prefill and decode roles (docs/design.md sections 3 and 11).

1. `worker.Worker` owns one model replica, its KV pages, its compute thread and its store clients (`stores`); the
   role driving it does not change the runner.
2. `prefill.role.PrefillRole` queues PREFILL jobs and its `prefill.batch.BatchRunner` runs `prefill.forward` on
   them; `kv.plan` prepares a prompt's KV (prefix to load, blocks to write here and on the decode host) and
   `request_kv` owns a request's pages.
3. `decode.role.DecodeRole` answers RESERVE and DECODE and runs `decode.loop`'s continuous batch.
4. `sampling` turns a wire `messages.SamplingSpec` into sampled tokens on the compute thread.

Nothing here is imported by this `__init__`: the wire messages (`messages`) load without torch, so the
conductor can use them.
"""
