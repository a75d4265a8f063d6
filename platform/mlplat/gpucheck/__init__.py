"""The prepared GPU check (issue 38): every CUDA path of the platform verified in one short run, Ray-free and
MLflow-free, from the source tree (``PYTHONPATH=platform python -m mlplat.gpucheck --out DIR``); docs/gpu.md.

Files: cli (arguments, imports, versions, one forked process per check, the JSON and the table), common (settings,
outcomes, the models the checks build, greedy comparison at a top-2 margin), engine_checks, train_checks, and
measure (timing helpers shared with benchmarks/).
"""
