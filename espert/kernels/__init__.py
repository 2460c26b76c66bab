"""The Triton kernels (``apply.py``: float weights, ``quant.py``: quantized lattices).

They read the launch plan that ``espert.ops`` builds and checks, and import nothing of ``espert.ops``:
ops calls kernels, never the other way (tests/test_layering.py)."""
