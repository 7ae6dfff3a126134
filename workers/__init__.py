"""What runs inside one generation actor: model loading, decoding engines, metrics, memory tracing.

Nothing here imports Ray: the worker class is usable on its own (``python -m tools.bench``).
"""
