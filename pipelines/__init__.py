"""Pipeline definitions: the quickstart first, then pipelines written with ``mlplat.pipeline``."""
