"""The training half of a step: scored rollouts in, optimizer steps and the step's metrics out.

``batch`` (:class:`TrainingBatch`, the rows a step trains on), ``packed_rows`` and ``micro_batches`` (how
those rows are cut), ``experience`` (what the update trains on), ``update`` (the policy update), ``step``
(:class:`GRPOStep`, one step stage by stage), ``step_metrics`` and ``diagnostics`` (what it logs).
Import from the modules; this file imports nothing.
"""
