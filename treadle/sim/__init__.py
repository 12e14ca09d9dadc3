"""`treadle sim`: replay a workload through the real Scheduler and KVCacheManager in virtual time.

workload.py (requests: bench workloads, JSONL traces, `bench serve --json` replays), profile.py
(the fitted step-time model), replica.py (one scheduler + cache on a virtual clock), simulator.py
(the event loop; replicas routed by the data-parallel server's own Router), report.py (metrics
and tables), commands.py (the CLI). Nothing here imports torch.
"""
