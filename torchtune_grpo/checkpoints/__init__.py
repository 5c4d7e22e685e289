"""A run's checkpoints: when one is due and what it holds (``manager``), where it lives on disk and how it
is written (``storage``), how a run resumes from one (``resume``), and what torchtune's checkpointers keep
private (``checkpointer_facts``). Import from the modules; this file imports nothing.
"""
