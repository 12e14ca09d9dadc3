"""`treadle sim`: replay a workload through the real Scheduler and KVCacheManager in virtual time.

workload.py (requests: bench workloads, JSONL traces, `bench serve --json` replays), profile.py
(the fitted step-time model), replica.py (one scheduler + cache on a virtual clock), router.py
(requests across replicas), simulator.py (the event loop), report.py (metrics and tables),
commands.py (the CLI). Nothing here imports torch.
"""
