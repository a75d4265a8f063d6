"""Ray Serve application builders (import paths for ``serve run``). The PD-disaggregated
OpenAI app lands here with the serving issue; the package exists so deploy configs can
name it from day one."""
