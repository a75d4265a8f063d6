"""mlplat: one platform for the life of an LLM on a Ray cluster.

Reusable components and the SDK live here; jobs live in ``train_apps/``,
``serve_apps/`` and ``pipelines/`` at the repository root.
"""

__version__ = "0.1.0"
