"""Generation workers: rollouts sampled by processes of their own, overlapped with training (docs/async.md).

``client`` is the trainer's side (:class:`WorkerRollouts`), ``process`` the worker process
(``python -m torchtune_grpo.workers.process --listen HOST:PORT``) and ``channel`` the transport between
them; ``config_checks`` refuses at setup what workers do not support. Import from the modules; this file imports nothing.
"""
