"""What reports share: percentiles as the benchmark and the fleet simulator
compute them (``stats.py``) and matplotlib set up for files (``plotting.py``).

Torch-free and importing nothing else of pdfleet: the benchmark (lean pods) and
the operator's simulator use it.
"""
