"""Offline tools, not imported by the runtime (``workers/``, ``orchestrator/``): the bench CLI, the tiny
and demo pairs and the drafter training behind them, local tensor-parallel process groups.

Each runs as ``python -m tools.<name>``; tests/workers/test_layering.py checks that nothing in the
runtime imports this package.
"""
