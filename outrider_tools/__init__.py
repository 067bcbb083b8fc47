"""Tools around the outrider server, not part of it: the demo family's trainer (demo/), the SmolLM2 DFlash
trainer, the acceptance measurement, the soak driver and the draft-policy simulator. Not installed with the server
(pyproject.toml packages only `outrider`): run them from a checkout (scripts/ has their command lines), where the
tests import them too, with the test extras installed (`pip install -e ".[test]"`: httpx for the soak driver).

They reuse the server's model modules: training runs outrider's own layers and drafter modules (their parameters
and packing) through dense.py, a training-mode forward over whole sequences with autograd."""
