"""One request's KV on a worker: where it comes from and goes to, its pages, staging and moves."""
