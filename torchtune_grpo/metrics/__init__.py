"""Numbers a run reports: per-rank ``sums`` reduced over ranks by key, the plain-file ``run_logs`` and
``tune-grpo plot``'s ``plotting``. Import from the modules; this file imports nothing.
"""
