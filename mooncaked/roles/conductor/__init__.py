"""The conductor: the cluster's front door and global scheduler (docs/design.md sections 3, 7 and 9).

A request's path through this package, as numbered stages:
1. `role.ConductorRole` starts the cluster view, the backend and the HTTP app (its lifecycle is in role.py).
2. `backend.ConductorBackend.prepare` tokenizes and keys a request (`frontend.ConductorRequest`).
3. `view.cluster.ClusterView` places it with Algorithm 1 over the shadow index that `view.store_follower` keeps
   from every store's events, predicting with `view.predictors`.
4. `request_run.RequestRun` drives its legs (RESERVE, PREFILL, DECODE) and settles it.

Nothing here is imported by this `__init__`: importing a submodule loads only what it needs.
"""
