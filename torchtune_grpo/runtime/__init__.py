"""Where and how a run executes: placement (FSDP2 ``sharding``, ``precision``, ``model_setup`` and
``lora_setup``), the ``collectives`` the stages take, and the run's guards (``nonfinite``, ``preemption``,
``output_lock``, the test-only ``crash_points``). Import from the modules; this file imports nothing.
"""
