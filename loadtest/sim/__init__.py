"""The simulator and planner: PDD deployments at a scale no test machine has.

A discrete-event model of instances, KV pools, the WAN and the local path, driven by the
router's and the relay's own policy code (``services.router.placement``, the odd-traffic rule,
the WAN estimator, ``services.relay_decode.handoff``), timed by a cost model that is either
measured on this machine (``pdd profile``) or derived from a chip's public specifications
through a roofline. See docs/planning.md.
"""
